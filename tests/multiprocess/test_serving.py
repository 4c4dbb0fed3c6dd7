"""`ling-serve --distributed` on the demo checkpoint: two processes of two CPU devices each, the experts sharded
across both (--mesh expert=4), with a prefix cache; process 0 serves HTTP. Through the official `openai` client:
greedy and seeded completions, whole and streamed, concurrent ones and a chat, equal each prompt run alone through
`Generator` (what the one-process server gives, tests/serving/test_server.py); a prefix-cache hit; then (last: it
ends the job) a killed process 1 makes the front end answer 503 and exit with status 1 within the timeout. And
a command's encoding round-trips its arrays and sampling parameters."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REPO_ROOT
from optional_deps import require_serve_extra

from ling_jax import load_hf_checkpoint, load_model_config
from ling_jax.generation.cli import DEMO_DIR
from ling_jax.generation.sampling import SamplingParams
from ling_jax.generation.tokenizer import load_tokenizer
from ling_jax.serving.replicated import decode, encode, params_of
from tests.multiprocess.conftest import environment, free_port
from tests.serving.conftest import Alone

require_serve_extra()
httpx = pytest.importorskip("httpx", reason="the server tests' client (the test extra)")
openai = pytest.importorskip("openai", reason="the server tests' client (the test extra)")

MODEL, CHUNK, MAX_TOKENS, TIMEOUT_S = "ling-demo", 16, 6, 15
FLAGS = ["--mesh", "expert=4", "--max-batch", "4", "--max-context", "64", "--prefill-chunk", str(CHUNK)]
FLAGS += ["--page-size", "8", "--prefix-cache-gb", "0.01", "--distributed-timeout", str(TIMEOUT_S)]
START_TIMEOUT_S = 400
LONG_PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"  # > 1 block
CASES = [  # (prompt, sampling)
    ("Once upon a time", SamplingParams(temperature=0.0)),
    ("She walked into the room and", SamplingParams(temperature=0.8, top_p=0.9, seed=3)),
    ("The letter was", SamplingParams(temperature=1.0, top_k=40, seed=7)),
    (LONG_PROMPT, SamplingParams(temperature=0.0)),
]


@dataclasses.dataclass(frozen=True)
class Job:
    processes: list[subprocess.Popen]
    url: str
    logs: Path

    def log(self, process: int) -> str:
        return (self.logs / f"{process}.log").read_text()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    logs = tmp_path_factory.mktemp("job")
    port, coordinator = free_port(), f"127.0.0.1:{free_port()}"
    processes = []
    for i in range(2):
        joining = ["--distributed", "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i)]
        command = [sys.executable, "-m", "ling_jax.serving", "--port", str(port), *FLAGS, *joining]
        with open(logs / f"{i}.log", "w") as out:
            processes.append(
                subprocess.Popen(
                    command, cwd=REPO_ROOT, env=environment(2), stdin=subprocess.DEVNULL, stdout=out, stderr=out
                )
            )
    yield Job(processes, f"http://127.0.0.1:{port}", logs)
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO_DIR, load_model_config(DEMO_DIR))


@pytest.fixture(scope="module")
def alone(job, tokenizer):
    return Alone(load_hf_checkpoint(DEMO_DIR, dtype=jnp.float32, progress=False), tokenizer, CHUNK)


@pytest.fixture(scope="module")
def references(alone, tokenizer):
    """Each case's completion run alone (computed while the job starts)."""
    return [alone(tokenizer.encode(text), sampling, MAX_TOKENS) for text, sampling in CASES]


@pytest.fixture(scope="module")
def client(job, references):
    deadline = time.monotonic() + START_TIMEOUT_S
    while _health(job.url) != 200:
        if any(p.poll() is not None for p in job.processes) or time.monotonic() > deadline:
            pytest.fail(f"the job did not start:\n{job.log(0)[-3000:]}\n{job.log(1)[-3000:]}")
        time.sleep(0.5)
    return openai.OpenAI(base_url=job.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def _health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.TransportError:
        return None


def _complete(client, case: int, stream: bool = False) -> str:
    text, sampling = CASES[case]
    args = {"temperature": sampling.temperature, "top_p": sampling.top_p, "seed": sampling.seed}
    reply = client.completions.create(
        model=MODEL, prompt=text, max_tokens=MAX_TOKENS, stream=stream, extra_body={"top_k": sampling.top_k}, **args
    )
    return "".join(chunk.choices[0].text for chunk in reply) if stream else reply.choices[0].text


def test_a_command_round_trips_with_its_arrays_and_sampling_parameters():
    params = SamplingParams(temperature=0.7, seed=5, logprobs=2, logit_bias=((3, -1.5),), end_ids=(1, 2))
    bitmask_W = np.arange(4, dtype=np.int32)
    command = encode("first_token", slot=1, row=None, params=dataclasses.asdict(params), bitmask_W=bitmask_W)
    op, fields = decode(command)
    assert (op, fields["slot"], fields["row"], params_of(fields["params"])) == ("first_token", 1, None, params)
    np.testing.assert_array_equal(fields["bitmask_W"], bitmask_W)


def test_completions_whole_streamed_and_concurrent_equal_each_run_alone(client, references, tokenizer):
    expected = [tokenizer.decode(ids) for ids in references]
    assert [_complete(client, case) for case in range(2)] == expected[:2]
    assert [_complete(client, case, stream=True) for case in range(2)] == expected[:2]
    with concurrent.futures.ThreadPoolExecutor(2 * len(CASES)) as pool:
        whole = pool.map(_complete, [client] * len(CASES), range(len(CASES)))
        streamed = pool.map(_complete, [client] * len(CASES), range(len(CASES)), [True] * len(CASES))
        assert list(whole) == list(streamed) == expected


def test_chat_whole_and_streamed_equals_the_chat_template_run_alone(client, alone, tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    expected = tokenizer.decode(alone(prompt, SamplingParams(temperature=0.6, seed=21), MAX_TOKENS))
    args = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.6, "seed": 21}
    assert client.chat.completions.create(**args).choices[0].message.content == expected
    chunks = client.chat.completions.create(stream=True, **args)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


def test_a_prefix_cache_hit_gives_the_same_tokens(client, references, tokenizer):
    again = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= CHUNK  # the case's earlier runs cached its blocks
    assert again.choices[0].text == tokenizer.decode(references[-1])


def test_a_killed_process_makes_the_front_end_answer_503_and_exit_1(job, client):
    front, follower = job.processes
    follower.kill()
    start = time.monotonic()
    while _health(job.url) != 503:
        assert time.monotonic() - start < TIMEOUT_S + 10 and front.poll() is None, job.log(0)[-3000:]
        time.sleep(0.2)
    assert front.wait(timeout=30) == 1
    assert f"error: process 1 stopped answering for --distributed-timeout {TIMEOUT_S} s" in job.log(0)
