"""OpenAI's sampling controls through the official `openai` client against `ling-serve` on the demo checkpoint
(with a prefix cache): `n` choices, `logit_bias`, `min_tokens`, `ignore_eos`, `stop_token_ids`, the penalties'
validation and `usage.prompt_tokens_details.cached_tokens`; in-process, `n` forks without the prefix cache's
layout and with MTP equal the request run alone."""

from __future__ import annotations

import pytest
from doc_blocks import blocks
from helpers import ONE_DEVICE_XLA_FLAGS, REPO_ROOT
from optional_deps import require_serve_extra

from ling_jax.generation.sampling import SamplingParams
from ling_jax.serving.engine import Engine
from ling_jax.serving.scheduler import Request, Scheduler

require_serve_extra()
openai = pytest.importorskip("openai", reason="the server tests' client (the test extra)")

MODEL, MAX_BATCH, MAX_TOKENS = "ling-demo", 4, 6
PROMPT = "It is a truth universally acknowledged, that a single man"  # 14 tokens: a partial page of 8
LONG_PROMPT = PROMPT + " in possession of a good fortune must be in want of a wife."  # past one prefix block


@pytest.fixture(scope="module")
def url(start_server):
    """A server of this module's own: the demo server has no prefix cache. At XLA's cheap level, with the faster-
    compiling emitters of the suite's subprocesses (its programs compile far longer than its requests run)."""
    flags = ["--max-batch", str(MAX_BATCH), "--max-context", "64", "--prefill-chunk", "16"]
    flags += ["--page-size", "8", "--prefix-cache-gb", "0.01"]
    with start_server(flags, {"XLA_FLAGS": ONE_DEVICE_XLA_FLAGS}) as server:
        yield server.ready()


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def token(demo_tokenizer):
    """A token id (" the") and its text."""
    (the,) = demo_tokenizer.encode(" the")
    return the, demo_tokenizer.decode([the])


def _complete(client, **args):
    return client.completions.create(**({"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS} | args))


def test_n_choices_greedy_equal_one_and_sampled_differ(client):
    single = _complete(client, temperature=0)
    reply = _complete(client, temperature=0, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert {c.text for c in reply.choices} == {single.choices[0].text}
    assert reply.usage.completion_tokens == 3 * single.usage.completion_tokens
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens

    sampled = _complete(client, temperature=1, seed=7, n=3)
    assert len({c.text for c in sampled.choices}) > 1
    assert sampled.choices[0].text == _complete(client, temperature=1, seed=7).choices[0].text  # choice 0: seed

    prompts = [PROMPT, "Once upon a time"]
    batched = client.completions.create(model=MODEL, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0, n=2)
    assert [c.index for c in batched.choices] == [0, 1, 2, 3]
    assert batched.choices[0].text == batched.choices[1].text == single.choices[0].text
    chunks = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0, n=2, stream=True
    )
    streamed = ["", "", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [c.text for c in batched.choices]

    messages = [{"role": "user", "content": "Hi!"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, n=2, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content


@pytest.mark.parametrize("temperature", [0, 1])
def test_logit_bias_forces_and_bans_a_token(client, token, demo_forward, demo_tokenizer, temperature):
    the, text = token
    forced = _complete(client, temperature=temperature, logit_bias={str(the): 100})
    assert forced.choices[0].text == text * MAX_TOKENS
    best = int(demo_forward(demo_tokenizer.encode(PROMPT))[-1].argmax())
    assert _complete(client, temperature=0, max_tokens=1).choices[0].text == demo_tokenizer.decode([best])
    for seed in range(3):
        banned = _complete(client, temperature=temperature, max_tokens=1, logit_bias={str(best): -100}, seed=seed)
        assert banned.choices[0].text != demo_tokenizer.decode([best])


def test_min_tokens_ignore_eos_and_stop_token_ids(client, token, demo_tokenizer):
    the, _ = token
    (eos,) = demo_tokenizer.eos_ids
    to_eos = {str(eos): 100}  # EOS first as soon as it is allowed
    assert _complete(client, temperature=0, logit_bias=to_eos).usage.completion_tokens == 0
    held = _complete(client, temperature=0, logit_bias=to_eos, extra_body={"min_tokens": 3})
    assert (held.usage.completion_tokens, held.choices[0].finish_reason) == (3, "stop")
    ignored = _complete(client, temperature=0, logit_bias=to_eos, extra_body={"ignore_eos": True})
    assert (ignored.usage.completion_tokens, ignored.choices[0].finish_reason) == (MAX_TOKENS, "length")
    to_the = {str(the): 100}
    stopped = _complete(client, temperature=1, logit_bias=to_the, extra_body={"stop_token_ids": [the]})
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == ("", "stop")
    later = _complete(client, temperature=0, logit_bias=to_the, extra_body={"stop_token_ids": [the], "min_tokens": 2})
    assert (later.usage.completion_tokens, later.choices[0].finish_reason) == (2, "stop")


def test_penalties_are_accepted_and_cached_tokens_count_a_prefix_hit(client):
    args = {"prompt": LONG_PROMPT, "temperature": 0, "presence_penalty": 1.5, "frequency_penalty": -0.5}
    first = _complete(client, **args)
    again = _complete(client, **args)
    assert again.choices[0].text == first.choices[0].text
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 16  # one block of --prefill-chunk


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", MAX_BATCH + 1),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {"1": 101}),
        ("logit_bias", {"4096": 1}),  # past the demo's vocabulary
        ("logit_bias", {str(t): 1 for t in range(301)}),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("min_tokens", MAX_TOKENS + 1),
        ("stop_token_ids", [-1]),
    ],
)
def test_bad_values_are_a_400_naming_the_field(client, field, value):
    with pytest.raises(openai.BadRequestError) as error:
        _complete(client, extra_body={field: value})
    assert error.value.body["param"] == field
    assert _complete(client, temperature=0, max_tokens=1).usage.completion_tokens == 1  # still serving


def test_the_docs_example_works_as_written(url, capsys):
    page = (REPO_ROOT / "docs" / "serving.md").read_text()
    example = next(b.code for b in blocks(page, "docs/serving.md") if "stop_token_ids" in b.code)
    exec(example.replace("http://127.0.0.1:8000", url), {"__name__": "docs_example"})
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed[:3]] == ["0", "1", "2"]
    completion_tokens, cached_tokens = map(int, printed[3].split())
    assert 12 <= completion_tokens <= 24 and cached_tokens == 0


def test_forked_choices_with_mtp_equal_the_request_alone(demo_model, demo_tokenizer, monkeypatch):
    """Greedy, three choices of one prompt (the left-padded layout, two forks with a partial page each, MTP drafts)
    equal the prompt run as one choice. Every step over all three slots: one speculative program to compile, not one
    per bucket (a request equals itself in any bucket: tests/serving/test_scheduler.py)."""
    engine = Engine(demo_model, max_batch=3, max_context=64, prefill_chunk=16, page_size=8, mtp=2)
    monkeypatch.setattr(engine, "decode_rows", lambda active_B: engine.max_batch)
    scheduler = Scheduler(engine, demo_tokenizer, eos_ids=demo_tokenizer.eos_ids, max_queue=1)
    prompt, greedy = demo_tokenizer.encode(PROMPT), SamplingParams(temperature=0.0)

    def run(choices: int) -> list[list[int]]:
        sinks = [[] for _ in range(choices)]
        requests = [Request(prompt, greedy, MAX_TOKENS, sink.append) for sink in sinks]
        requests[0].siblings = requests[1:]
        scheduler.submit(requests[0])
        for _ in range(50):
            if all(sink and sink[-1].finish is not None for sink in sinks):
                break
            scheduler._step()
        return [[t for delta in sink for t in delta.token_ids] for sink in sinks]

    (alone,) = run(1)
    assert len(alone) == MAX_TOKENS and run(3) == [alone] * 3
