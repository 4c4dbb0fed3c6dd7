"""`ling-serve` on the demo checkpoint (the serving tests' shared demo server, tests/serving/conftest.py, on a free
port of 127.0.0.1), driven with the official `openai` client and httpx: completions and chat, streamed and whole,
equal to `Generator` run alone; 32 concurrent streaming clients; a client disconnecting; bad input; a full queue;
SIGTERM (on a server of its own with the same flags). Every load is bounded in requests and time."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import shutil
import signal
import subprocess
import time

import pytest
from doc_blocks import blocks
from helpers import REPO_ROOT
from optional_deps import require_serve_extra
from served import DEMO_CHUNK, DEMO_MAX_BATCH, DEMO_MAX_QUEUE, DEMO_SERVER_ENV, DEMO_SERVER_FLAGS

from ling_jax.generation.sampling import SamplingParams
from ling_jax.generation.tokenizer import StopChecker

require_serve_extra()
httpx = pytest.importorskip("httpx", reason="the server tests' client (the test extra)")
openai = pytest.importorskip("openai", reason="the server tests' client (the test extra)")

MODEL = "ling-demo"
README_URL = "http://127.0.0.1:8000"
REQUEST_TIMEOUT_S = 60
MAX_TOKENS = 8
LONG_PROMPT = (
    "Mr. Bennet was among the earliest of those who waited on Mr. Bingley. He had always intended to visit him, "
    "though to the last always assuring his wife that he should not go"
)  # three prefill chunks
CASES = [  # (prompt, sampling); every request asks for at most MAX_TOKENS tokens
    ("It is a truth universally acknowledged", SamplingParams(temperature=0.0)),
    ("Once upon a time", SamplingParams(temperature=0.8, top_p=0.9, seed=3)),
    (LONG_PROMPT, SamplingParams(temperature=0.0)),
    ("She walked into the room and", SamplingParams(temperature=1.0, top_k=40, repetition_penalty=1.3, seed=7)),
    ("The letter was", SamplingParams(temperature=0.7, min_p=0.05, seed=11)),
    ("My dear", SamplingParams(temperature=0.0, repetition_penalty=1.2)),
    (LONG_PROMPT + " at all", SamplingParams(temperature=0.9, top_p=0.8, seed=5)),
    ("I", SamplingParams(temperature=1.0, seed=2)),
]


@pytest.fixture(scope="module")
def url(demo_server, references):
    """The demo server's URL once /health answers; the references are computed first, while it starts."""
    return demo_server.ready()


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)


@pytest.fixture(scope="module")
def references(demo_server, alone, demo_tokenizer):
    """Each case's prompt ids and its MAX_TOKENS-token completion run alone (computed while the server starts)."""
    reference = alone(DEMO_CHUNK)
    prompts = [demo_tokenizer.encode(text) for text, _ in CASES]
    return [(ids, reference(ids, sampling, MAX_TOKENS)) for ids, (_, sampling) in zip(prompts, CASES)]


def _sampling_args(sampling: SamplingParams) -> dict:
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "seed": sampling.seed,
        "extra_body": {
            "top_k": sampling.top_k,
            "min_p": sampling.min_p,
            "repetition_penalty": sampling.repetition_penalty,
        },
    }


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, flags=re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _idle(url: str) -> bool:
    return _metric(url, "ling_serve_running_batch") == 0 and _metric(url, "ling_serve_queue_depth") == 0


def _expected(tokenizer, ids: list[int], max_tokens: int) -> tuple[str, int, str]:
    """(text, completion tokens, finish reason) of the first max_tokens of a reference completion."""
    kept = ids[:max_tokens]
    return tokenizer.decode(kept), len(kept), "length" if len(kept) == max_tokens else "stop"


def test_models_and_health(url, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_completions_equal_generator_whole_and_streamed(client, references, demo_tokenizer):
    def whole(case: int):
        text, sampling = CASES[case]
        return client.completions.create(model=MODEL, prompt=text, max_tokens=MAX_TOKENS, **_sampling_args(sampling))

    def streamed(case: int):
        text, sampling = CASES[case]
        args = _sampling_args(sampling)
        return list(client.completions.create(model=MODEL, prompt=text, max_tokens=MAX_TOKENS, stream=True, **args))

    with concurrent.futures.ThreadPoolExecutor(len(CASES) + 3) as pool:
        replies = list(pool.map(whole, range(len(CASES))))
        streams = list(pool.map(streamed, range(3)))
    for (text, _), (prompt_ids, ids), reply in zip(CASES, references, replies):
        choice = reply.choices[0]
        expected = _expected(demo_tokenizer, ids, MAX_TOKENS)
        assert (choice.text, reply.usage.completion_tokens, choice.finish_reason) == expected, text
        assert reply.usage.prompt_tokens == len(prompt_ids)
    for (text, _), (_, ids), chunks in zip(CASES, references, streams):
        assert "".join(c.choices[0].text for c in chunks) == demo_tokenizer.decode(ids), text
        assert chunks[-1].choices[0].finish_reason == _expected(demo_tokenizer, ids, MAX_TOKENS)[2]
        # a chunk a token as it is decoded (empty text where the token's is held back), then the finish's
        assert len(chunks) == len(ids[:MAX_TOKENS]) + 1, text


def test_chat_equals_generator_on_the_chat_template(client, alone, demo_tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi! Who are you?"}]
    prompt = demo_tokenizer.encode(demo_tokenizer.apply_chat_template(messages), add_special_tokens=False)
    sampling = SamplingParams(temperature=0.6, top_p=0.95, seed=21)
    text, count, finish = _expected(demo_tokenizer, alone(DEMO_CHUNK)(prompt, sampling, MAX_TOKENS), MAX_TOKENS)
    args = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, **_sampling_args(sampling)}
    reply = client.chat.completions.create(**args)
    assert reply.choices[0].message.content == text and reply.choices[0].message.role == "assistant"
    assert (reply.usage.completion_tokens, reply.usage.prompt_tokens, reply.choices[0].finish_reason) == (
        count,
        len(prompt),
        finish,
    )
    assert getattr(reply.choices[0].message, "reasoning_content", None) is None  # the demo template marks none
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == count and not chunks[-1].choices


def test_stop_string_ends_the_completion_before_it(client, references, demo_tokenizer):
    (text, sampling), (_, ids) = CASES[2], references[2]
    full = demo_tokenizer.decode(ids)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    cut = StopChecker([stop]).find(full)
    args = {"model": MODEL, "prompt": text, "max_tokens": MAX_TOKENS, "stop": [stop], **_sampling_args(sampling)}
    reply = client.completions.create(**args)
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (full[:cut], "stop")
    # streamed: a chunk for every token, those whose text is held back (a possible start of the stop) empty
    chunks = list(client.completions.create(stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == full[:cut]
    assert len(chunks) == reply.usage.completion_tokens + 1 and chunks[-1].choices[0].finish_reason == "stop"


def test_32_concurrent_streaming_clients_each_equal_alone(url, references, demo_tokenizer):
    """Mixed prompts (one and two prefill chunks) and output lengths (1 to MAX_TOKENS): more requests than
    slots, so requests join the running batch as others leave it."""
    jobs = [(i % len(CASES), 1 + (5 * i) % MAX_TOKENS) for i in range(32)]

    async def one(aclient, case: int, max_tokens: int) -> tuple[str, str | None]:
        text, sampling = CASES[case]
        stream = await aclient.completions.create(
            model=MODEL, prompt=text, max_tokens=max_tokens, stream=True, **_sampling_args(sampling)
        )
        pieces, finish = [], None
        async for chunk in stream:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(pieces), finish

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)
        async with aclient:
            return await asyncio.wait_for(asyncio.gather(*(one(aclient, c, m) for c, m in jobs)), 4 * REQUEST_TIMEOUT_S)

    finished_before = _metric(url, 'ling_serve_requests_total{finish_reason="length"}')
    results = asyncio.run(run_all())
    for (case, max_tokens), (text, finish) in zip(jobs, results):
        expected_text, _, expected_finish = _expected(demo_tokenizer, references[case][1], max_tokens)
        assert (text, finish) == (expected_text, expected_finish), (case, max_tokens)
    assert _idle(url)  # no slot or queue entry leaked
    lengths = sum(_expected(demo_tokenizer, references[c][1], m)[2] == "length" for c, m in jobs)
    assert _metric(url, 'ling_serve_requests_total{finish_reason="length"}') - finished_before == lengths


def test_disconnected_client_frees_its_slot(url):
    cancelled = _metric(url, 'ling_serve_requests_total{finish_reason="cancelled"}')
    tokens = _metric(url, "ling_serve_generated_tokens_total")
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 100, "stream": True, "temperature": 0}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 20
    while not _idle(url) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _idle(url)
    assert _metric(url, 'ling_serve_requests_total{finish_reason="cancelled"}') == cancelled + 1
    assert _metric(url, "ling_serve_generated_tokens_total") - tokens < 50  # it stopped long before 100 tokens


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b'{"model": "ling-demo", "prompt": "a",', 400, None),  # malformed JSON
        (b'{"model": "ling-demo", "prompt": "a", "max_tokens": "5"}', 400, "max_tokens"),
        (b'{"model": "ling-demo", "prompt": 7}', 400, "prompt"),
        (b'{"model": "ling-demo", "prompt": "a", "temperature": -1}', 400, "temperature"),
        (b'{"model": "ling-demo", "prompt": "a", "max_tokens": 0}', 400, "max_tokens"),
        (b'{"model": "ling-demo", "prompt": "a", "max_tokens": 500}', 400, "max_tokens"),
        (b'{"model": "ling-demo", "prompt": [5' + b", 5" * 130 + b"]}", 400, "prompt"),  # longer than the context
        (b'{"model": "gpt-4", "prompt": "a"}', 404, "model"),
    ],
)
def test_bad_input_gets_the_openai_error_schema(url, body, status, param):
    response = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param


def test_official_client_raises_on_bad_input(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=-1)


def test_a_text_model_refuses_image_parts(client):
    """An image_url part (here a data: URL) on the text model: a 400 naming the part, nothing generated."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert error.value.body["param"] == "messages"
    assert error.value.body["message"].startswith("messages.0.content.1: image_url parts need a VL checkpoint")


def test_full_queue_is_refused_and_the_rest_served(url):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1, "temperature": 0}

    total = DEMO_MAX_BATCH + DEMO_MAX_QUEUE + 12

    async def run_all():
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
            requests = [http.post(url + "/v1/completions", json=body) for _ in range(total)]
            return await asyncio.gather(*requests)

    responses = asyncio.run(run_all())
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 503}, statuses
    assert statuses.count(200) >= DEMO_MAX_BATCH + DEMO_MAX_QUEUE - 4  # a few may finish before the last ones arrive
    assert all(r.json()["error"]["type"] for r in responses if r.status_code == 503)
    texts = {r.json()["choices"][0]["text"] for r in responses if r.status_code == 200}
    assert len(texts) == 1  # the same greedy request: the same answer in every slot
    assert _idle(url)


def test_readme_examples_work_as_written(url, capsys):
    """The README's curl and openai-client examples, pointed at this server instead of port 8000."""
    readme = (REPO_ROOT / "README.md").read_text()
    examples = [b for b in blocks(readme, "README.md") if README_URL in b.code]
    curl = next(b.code for b in examples if b.lang == "bash")
    python = next(b.code for b in examples if b.lang == "python")
    if shutil.which("curl"):
        out = subprocess.run(["bash", "-c", curl.replace(README_URL, url)], capture_output=True, text=True, check=True)
        assert json.loads(out.stdout)["choices"][0]["finish_reason"] in ("length", "stop")
    exec(python.replace(README_URL, url), {"__name__": "readme_example"})
    assert capsys.readouterr().out.strip()


def test_sigterm_finishes_in_flight_requests_refuses_new_ones_and_exits_0(start_server):
    """On a demo server of its own (the test stops it), which reads every program from the run's compile cache."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "stream": True, "temperature": 0}
    with start_server(DEMO_SERVER_FLAGS, DEMO_SERVER_ENV) as server:
        url = server.ready()
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            server.process.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            with pytest.raises(httpx.TransportError):
                httpx.get(url + "/health", timeout=5)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
        assert server.process.wait(timeout=60) == 0
