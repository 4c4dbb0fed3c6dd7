"""`ling-serve --distributed` as 2 and 4 `jax.distributed` CPU processes, one job each for the whole module: the demo
checkpoint on two processes of two devices, and the random `tiny` preset on four processes of one device; both shard the
experts across every process (`--mesh expert=4`) and keep a prefix cache; process 0 serves HTTP. Through the official
`openai` client: 8 concurrent completions (more than the slots), greedy and seeded, each prompt whole and streamed at
once (the same prompt twice in flight), and (the demo's tokenizer has a chat template) greedy and seeded chats, equal
each prompt run alone through `Generator` on the model one-process `ling-serve` loads (what its server gives:
tests/serving/test_server.py), the first of them compiling nothing in any process (`ready` came after every program a
request can use; each process reports a compilation after its warm-up, as the prompt logprobs' at their first request
show); a prefix-cache hit; then (last: it ends the job) a killed process makes the front end answer 503 and exit with
status 1 within the timeout. And a command's encoding round-trips its arrays and sampling parameters."""

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

from ling_jax.checkpoints.hf import STORED
from ling_jax.generation import cli_checks
from ling_jax.generation.cli import DEMO_DIR, load_model
from ling_jax.generation.sampling import SamplingParams
from ling_jax.policy import ExecutionPolicy
from ling_jax.serving.replicated import decode, encode, params_of
from tests.multiprocess.conftest import environment, free_port
from tests.serving.conftest import Alone, reference_compile_cache

require_serve_extra()
httpx = pytest.importorskip("httpx", reason="the server tests' client (the test extra)")
openai = pytest.importorskip("openai", reason="the server tests' client (the test extra)")

CHUNK, MAX_TOKENS, TIMEOUT_S, START_TIMEOUT_S = 16, 6, 10, 400
FLAGS = ["--mesh", "expert=4", "--prefill-chunk", str(CHUNK), "--page-size", "8", "--prefix-cache-gb", "0.01"]
FLAGS += ["--distributed-timeout", str(TIMEOUT_S)]
LONG_PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"  # > 1 block
CASES = [  # (prompt, sampling)
    ("Once upon a time", SamplingParams(temperature=0.0)),
    ("She walked into the room and", SamplingParams(temperature=0.8, top_p=0.9, seed=3)),
    ("The letter was", SamplingParams(temperature=1.0, top_k=40, seed=7)),
    (LONG_PROMPT, SamplingParams(temperature=0.0)),
]
CHAT = [{"role": "user", "content": "Hi"}]
CHAT_SAMPLING = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.6, seed=21)]


@dataclasses.dataclass(frozen=True)
class Setup:
    """A served job: `processes` processes of `devices` CPU devices each, serving the demo checkpoint or a preset."""

    processes: int
    devices: int
    preset: str | None  # None: the demo checkpoint
    flags: tuple[str, ...]  # besides FLAGS

    @property
    def model(self) -> str:
        """The name the server answers to."""
        return self.preset or DEMO_DIR.name

    def source(self) -> cli_checks.ModelSource:
        if self.preset is None:
            return cli_checks.checkpoint_source(DEMO_DIR, "--model", byte_tokenizer=None)
        return cli_checks.preset_source(self.preset)


# the demo: one slot (requests wait for it), several decode steps a program (the default); the preset (prompts are
# bytes, hence the longer context): batch buckets 1 and 2 (a bucket below --max-batch, an idle slot under an active
# one), one step a program. Each decode bucket is a program every process compiles before `ready`.
DEMO = Setup(2, 2, None, ("--max-batch", "1", "--max-context", "64"))
TINY = Setup(4, 1, "tiny", ("--preset", "tiny", "--max-batch", "2", "--decode-steps", "1", "--max-context", "128"))


@dataclasses.dataclass(frozen=True)
class Job:
    setup: Setup
    processes: list[subprocess.Popen]
    url: str
    logs: Path

    def log(self, process: int) -> str:
        return (self.logs / f"{process}.log").read_text()


@pytest.fixture(scope="module", params=[DEMO, TINY], ids=["2-processes-demo", "4-processes-tiny"])
def job(request, tmp_path_factory):
    setup = request.param
    logs = tmp_path_factory.mktemp("job")
    port, coordinator = free_port(), f"127.0.0.1:{free_port()}"
    processes = []
    for i in range(setup.processes):
        joining = ["--distributed", "--coordinator", coordinator, "--num-processes", str(setup.processes)]
        command = [sys.executable, "-m", "ling_jax.serving", "--port", str(port), *FLAGS, *setup.flags, *joining]
        with open(logs / f"{i}.log", "w") as out:
            processes.append(
                subprocess.Popen(
                    [*command, "--process-id", str(i)],
                    cwd=REPO_ROOT,
                    env=environment(setup.devices),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                )
            )
    yield Job(setup, processes, f"http://127.0.0.1:{port}", logs)
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def source(job):
    return job.setup.source()


@pytest.fixture(scope="module")
def alone(job, source, tmp_path_factory):
    """The job's model as one-process `ling-serve` loads it, each request run alone (loaded while the job starts)."""
    model = load_model(source, jnp.float32, None, ExecutionPolicy(), STORED, verbose=False)
    return Alone(model, source.tokenizer, CHUNK, reference_compile_cache(tmp_path_factory))


@pytest.fixture(scope="module")
def references(alone, source):
    """Each case's completion run alone (computed while the job starts)."""
    return [source.tokenizer.decode(alone(source.tokenizer.encode(text), s, MAX_TOKENS)) for text, s in CASES]


@pytest.fixture(scope="module")
def client(job, references):
    deadline = time.monotonic() + START_TIMEOUT_S
    while _health(job.url) != 200:
        if any(p.poll() is not None for p in job.processes) or time.monotonic() > deadline:
            logs = "\n".join(job.log(i)[-3000:] for i in range(len(job.processes)))
            pytest.fail(f"the job did not start:\n{logs}")
        time.sleep(0.5)
    return openai.OpenAI(base_url=job.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def _health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.TransportError:
        return None


def _complete(client, model: str, case: int, stream: bool) -> str:
    text, sampling = CASES[case]
    args = {"temperature": sampling.temperature, "top_p": sampling.top_p, "seed": sampling.seed}
    reply = client.completions.create(
        model=model, prompt=text, max_tokens=MAX_TOKENS, stream=stream, extra_body={"top_k": sampling.top_k}, **args
    )
    return "".join(chunk.choices[0].text for chunk in reply) if stream else reply.choices[0].text


def _chat(client, model: str, sampling: SamplingParams, stream: bool) -> str:
    args = {"temperature": sampling.temperature, "seed": sampling.seed}
    reply = client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, stream=stream, **args)
    if stream:
        return "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)
    return reply.choices[0].message.content


def _compiled_while_serving(job: Job) -> list[list[str]]:
    """Each process's lines reporting an XLA compilation after its warm-up (`replicated.report_compiles`)."""
    return [[line for line in job.log(i).splitlines() if "while serving" in line] for i in range(len(job.processes))]


def test_a_command_round_trips_with_its_arrays_and_sampling_parameters():
    params = SamplingParams(temperature=0.7, seed=5, logprobs=2, logit_bias=((3, -1.5),), end_ids=(1, 2))
    bitmask_W = np.arange(4, dtype=np.int32)
    command = encode("first_token", slot=1, row=None, params=dataclasses.asdict(params), bitmask_W=bitmask_W)
    op, fields = decode(command)
    assert (op, fields["slot"], fields["row"], params_of(fields["params"])) == ("first_token", 1, None, params)
    np.testing.assert_array_equal(fields["bitmask_W"], bitmask_W)


def test_8_concurrent_completions_whole_and_streamed_equal_each_run_alone(job, client, references):
    # more than the slots (--max-batch 1 and 2): requests wait for a slot; each prompt twice in flight
    requests = [(case, stream) for case in range(len(CASES)) for stream in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        texts = pool.map(lambda request: _complete(client, job.setup.model, *request), requests)
        assert list(texts) == [references[case] for case, _ in requests]
    # the job's first batch: every program it ran was run by the warm-up, in every process
    assert _compiled_while_serving(job) == [[]] * len(job.processes)


@pytest.mark.parametrize("job", [DEMO], indirect=True, ids=["2-processes-demo"])
def test_greedy_and_seeded_chats_whole_and_streamed_equal_the_chat_template_run_alone(job, client, alone, source):
    prompt = source.tokenizer.encode(source.tokenizer.apply_chat_template(CHAT), add_special_tokens=False)
    expected = [source.tokenizer.decode(alone(prompt, sampling, MAX_TOKENS)) for sampling in CHAT_SAMPLING]
    requests = [(sampling, stream) for sampling in CHAT_SAMPLING for stream in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        texts = pool.map(lambda request: _chat(client, job.setup.model, *request), requests)
        assert list(texts) == [expected[i // 2] for i in range(len(requests))]


def test_a_prefix_cache_hit_gives_the_same_tokens(job, client, references):
    again = client.completions.create(model=job.setup.model, prompt=LONG_PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= CHUNK  # the case's earlier runs cached its blocks
    assert again.choices[0].text == references[-1]


@pytest.mark.parametrize("job", [TINY], indirect=True, ids=["4-processes-tiny"])
def test_a_program_compiled_while_serving_is_reported_by_every_process(job, client):
    # a prompt's logprobs compile at their first request (the warm-up leaves them): the report the first batch's
    # test reads names them
    client.completions.create(model=job.setup.model, prompt=CASES[0][0], max_tokens=0, logprobs=1, echo=True)
    for lines in _compiled_while_serving(job):
        assert any("compiled jit(_prompt_chunk_logprobs) while serving" in line for line in lines), lines


def test_a_killed_process_makes_the_front_end_answer_503_and_exit_1(job, client):
    front, last = job.processes[0], job.processes[-1]
    last.kill()
    start = time.monotonic()
    while _health(job.url) != 503:
        assert time.monotonic() - start < TIMEOUT_S + 10 and front.poll() is None, job.log(0)[-3000:]
        time.sleep(0.2)
    assert front.wait(timeout=30) == 1
    gone = len(job.processes) - 1
    assert f"error: process {gone} stopped answering for --distributed-timeout {TIMEOUT_S} s" in job.log(0)
