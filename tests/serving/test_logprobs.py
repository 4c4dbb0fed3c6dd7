"""Logprobs, echo and batched prompts through the official `openai` client against `ling-serve` on the demo
checkpoint (float32; the serving tests' shared demo server, tests/serving/conftest.py): every logprob equals the
log-softmax of `LingForCausalLM`'s logits over the same tokens (in-process with MTP speculation and the prefix cache's
prompt layout: tests/serving/test_scheduler.py)."""

from __future__ import annotations

import numpy as np
import pytest
from optional_deps import require_serve_extra

from tests.serving.conftest import LOGPROBS_MAX_TOKENS, LOGPROBS_PROMPT, LOGPROBS_TOLERANCE, logprobs_close

require_serve_extra()
httpx = pytest.importorskip("httpx", reason="the server tests' client (the test extra)")
openai = pytest.importorskip("openai", reason="the server tests' client (the test extra)")

MODEL = "ling-demo"


@pytest.fixture(scope="module")
def client(demo_server, greedy):
    """The shared demo server's client (the greedy reference is computed first, while the server starts)."""
    return openai.OpenAI(base_url=demo_server.ready() + "/v1", api_key="unused", timeout=120, max_retries=0)


def _check_legacy(logprobs, ids: list[int], first: int, reference: np.ndarray, k: int, tokenizer) -> None:
    """OpenAI's legacy logprobs of ids[first:] (position i given ids[:i]) against the forward pass."""
    for position, token, value, top in zip(
        range(first, len(ids)), logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs
    ):
        assert token == tokenizer.decode([ids[position]], skip_special_tokens=False)
        if position == 0:
            assert value is None and top is None
            continue
        row = reference[position - 1]
        assert logprobs_close(value, row[ids[position]])
        best = np.argsort(-row)[:k]
        expected = {tokenizer.decode([int(t)], skip_special_tokens=False): row[t] for t in best}
        assert top.keys() == expected.keys() | {token}
        assert logprobs_close([top[t] for t in expected], list(expected.values()))


def test_completion_logprobs_and_echo_equal_the_forward_pass(client, greedy, greedy_log_probs, demo_tokenizer):
    prompt, ids = greedy
    args = {
        "model": MODEL,
        "prompt": LOGPROBS_PROMPT,
        "max_tokens": LOGPROBS_MAX_TOKENS,
        "temperature": 0,
        "logprobs": 2,
    }
    plain = client.completions.create(**args).choices[0]
    assert plain.text == demo_tokenizer.decode(ids[len(prompt) :])
    _check_legacy(plain.logprobs, ids, len(prompt), greedy_log_probs, 2, demo_tokenizer)
    assert plain.logprobs.text_offset[0] == 0

    echoed = client.completions.create(echo=True, **args).choices[0]
    assert echoed.text == LOGPROBS_PROMPT + plain.text
    assert len(echoed.logprobs.tokens) == len(ids)
    _check_legacy(echoed.logprobs, ids, 0, greedy_log_probs, 2, demo_tokenizer)
    assert echoed.logprobs.text_offset[len(prompt)] == len(LOGPROBS_PROMPT)

    scored = client.completions.create(**(args | {"max_tokens": 0, "logprobs": 1}), echo=True)
    assert (scored.choices[0].text, scored.choices[0].finish_reason) == (LOGPROBS_PROMPT, "length")
    assert scored.usage.completion_tokens == 0
    _check_legacy(scored.choices[0].logprobs, prompt, 0, greedy_log_probs, 1, demo_tokenizer)

    chunks = list(client.completions.create(stream=True, echo=True, **args))
    streamed = [c.choices[0] for c in chunks if c.choices[0].text]
    assert all(c.logprobs is not None and c.logprobs.tokens for c in streamed)
    assert "".join(c.text for c in streamed) == echoed.text
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((getattr(c.logprobs, field) for c in streamed), []) == getattr(echoed.logprobs, field)


def test_chat_logprobs_shape_whole_and_streamed(client, demo_tokenizer):
    args = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": LOGPROBS_MAX_TOKENS}
    args |= {"temperature": 0.7, "seed": 5, "logprobs": True, "top_logprobs": 3}
    reply = client.chat.completions.create(**args)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.logprob - LOGPROBS_TOLERANCE
    chunks = list(client.chat.completions.create(stream=True, **args))
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert all(c.choices[0].logprobs for c in chunks if c.choices[0].delta.content)


def test_batched_prompts_equal_separate_requests(client, demo_tokenizer):
    prompts = ["Once upon a time", "The letter was", LOGPROBS_PROMPT]
    args = {"model": MODEL, "max_tokens": LOGPROBS_MAX_TOKENS, "temperature": 0}
    alone = [client.completions.create(prompt=p, **args) for p in prompts]
    for batch in (prompts, [demo_tokenizer.encode(p) for p in prompts]):
        reply = client.completions.create(prompt=batch, **args)
        assert [c.index for c in reply.choices] == [0, 1, 2]
        assert [c.text for c in reply.choices] == [r.choices[0].text for r in alone]
        assert reply.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)
        assert reply.usage.completion_tokens == sum(r.usage.completion_tokens for r in alone)
    chunks = list(client.completions.create(prompt=prompts, stream=True, **args))
    for index, reply in enumerate(alone):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == index) == reply.choices[0].text


@pytest.mark.parametrize(
    ("route", "field", "value"),
    [("chat", "top_logprobs", -1), ("chat", "top_logprobs", 21), ("completions", "logprobs", 21)],
)
def test_out_of_range_logprobs_are_a_400_naming_the_field(client, route, field, value):
    with pytest.raises(openai.BadRequestError) as error:
        if route == "chat":
            messages = [{"role": "user", "content": "Hi"}]
            client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, **{field: value})
        else:
            client.completions.create(model=MODEL, prompt="Hi", **{field: value})
    assert error.value.body["param"] == field
