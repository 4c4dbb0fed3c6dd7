"""Logprobs, echo and batched prompts through the official `openai` client against `ling-serve` on the demo
checkpoint (float32; the serving tests' shared demo server, tests/serving/conftest.py): every logprob equals the
log-softmax of `LingForCausalLM`'s logits over the same tokens. In-process, the same with MTP speculation and the
prefix cache's prompt layout (right-padded chunks)."""

from __future__ import annotations

import numpy as np
import pytest
from optional_deps import require_serve_extra

from ling_jax.generation.sampling import SamplingParams
from ling_jax.serving.engine import Engine
from ling_jax.serving.scheduler import Request, Scheduler

require_serve_extra()
httpx = pytest.importorskip("httpx", reason="the server tests' client (the test extra)")
openai = pytest.importorskip("openai", reason="the server tests' client (the test extra)")

MODEL = "ling-demo"
PROMPT = "It is a truth universally acknowledged, that a single man"  # two prefill chunks of 16
MAX_TOKENS = 4
TOLERANCE = 1e-4  # relative or absolute, per value


@pytest.fixture(scope="module")
def client(demo_server, greedy):
    """The shared demo server's client (the greedy reference is computed first, while the server starts)."""
    return openai.OpenAI(base_url=demo_server.ready() + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def greedy(demo_tokenizer, demo_forward):
    """The prompt's ids and its MAX_TOKENS greedy tokens (none is EOS), from forward passes over the final length
    (one compiled program): a position's logits do not depend on the placeholder tokens after it."""
    prompt = demo_tokenizer.encode(PROMPT)
    ids = prompt + [0] * MAX_TOKENS
    for position in range(len(prompt), len(ids)):
        ids[position] = int(demo_forward(ids)[position - 1].argmax())
    assert not set(ids[len(prompt) :]) & set(demo_tokenizer.eos_ids)
    return prompt, ids


@pytest.fixture(scope="module")
def reference(greedy, demo_forward):
    """[L, V] log-softmax at each position of the prompt and its greedy tokens, from one forward pass."""
    return demo_forward(greedy[1])


def _close(got, expected) -> bool:
    return np.allclose(got, expected, rtol=TOLERANCE, atol=TOLERANCE)


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
        assert _close(value, row[ids[position]])
        best = np.argsort(-row)[:k]
        expected = {tokenizer.decode([int(t)], skip_special_tokens=False): row[t] for t in best}
        assert top.keys() == expected.keys() | {token}
        assert _close([top[t] for t in expected], list(expected.values()))


def test_completion_logprobs_and_echo_equal_the_forward_pass(client, greedy, reference, demo_tokenizer):
    prompt, ids = greedy
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 2}
    plain = client.completions.create(**args).choices[0]
    assert plain.text == demo_tokenizer.decode(ids[len(prompt) :])
    _check_legacy(plain.logprobs, ids, len(prompt), reference, 2, demo_tokenizer)
    assert plain.logprobs.text_offset[0] == 0

    echoed = client.completions.create(echo=True, **args).choices[0]
    assert echoed.text == PROMPT + plain.text
    assert len(echoed.logprobs.tokens) == len(ids)
    _check_legacy(echoed.logprobs, ids, 0, reference, 2, demo_tokenizer)
    assert echoed.logprobs.text_offset[len(prompt)] == len(PROMPT)

    scored = client.completions.create(**(args | {"max_tokens": 0, "logprobs": 1}), echo=True)
    assert (scored.choices[0].text, scored.choices[0].finish_reason) == (PROMPT, "length")
    assert scored.usage.completion_tokens == 0
    _check_legacy(scored.choices[0].logprobs, prompt, 0, reference, 1, demo_tokenizer)

    chunks = list(client.completions.create(stream=True, echo=True, **args))
    streamed = [c.choices[0] for c in chunks if c.choices[0].text]
    assert all(c.logprobs is not None and c.logprobs.tokens for c in streamed)
    assert "".join(c.text for c in streamed) == echoed.text
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((getattr(c.logprobs, field) for c in streamed), []) == getattr(echoed.logprobs, field)


def test_chat_logprobs_shape_whole_and_streamed(client, demo_tokenizer):
    args = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": MAX_TOKENS}
    args |= {"temperature": 0.7, "seed": 5, "logprobs": True, "top_logprobs": 3}
    reply = client.chat.completions.create(**args)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.logprob - TOLERANCE
    chunks = list(client.chat.completions.create(stream=True, **args))
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert all(c.choices[0].logprobs for c in chunks if c.choices[0].delta.content)


def test_batched_prompts_equal_separate_requests(client, demo_tokenizer):
    prompts = ["Once upon a time", "The letter was", PROMPT]
    args = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0}
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


def test_mtp_and_prefix_layout_logprobs_equal_the_forward_pass(demo_model, demo_tokenizer, greedy, reference):
    prompt, ids = greedy
    engine = Engine(
        demo_model, max_batch=1, max_context=64, prefill_chunk=16, page_size=8, prefix_cache_bytes=1 << 20, mtp=2
    )
    scheduler = Scheduler(engine, demo_tokenizer, eos_ids=demo_tokenizer.eos_ids, max_queue=1)
    sink = []
    sampling = SamplingParams(temperature=0.0, logprobs=2)
    scheduler.submit(Request(prompt, sampling, MAX_TOKENS, sink.append, prompt_logprobs=True))
    for _ in range(50):
        if sink and sink[-1].finish is not None:
            break
        scheduler._step()
    assert [t for delta in sink for t in delta.token_ids] == ids[len(prompt) :]
    generated = [e for delta in sink for e in delta.logprobs]
    for first, entries in ((1, sink[0].prompt_logprobs), (len(prompt), generated)):
        assert [e.token for e in entries] == ids[first : first + len(entries)]
        assert first + len(entries) == (len(prompt) if first == 1 else len(ids))
        for position, entry in zip(range(first, len(ids)), entries):
            row = reference[position - 1]
            assert _close(entry.logprob, row[entry.token])
            top_ids, top = zip(*entry.top)
            assert _close(top, np.sort(row)[::-1][:2]) and _close(top, row[list(top_ids)])
