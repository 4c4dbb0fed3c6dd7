"""The demo checkpoint in-process and `Generator` references: what a request gives when run alone; `ling-serve` on
the demo checkpoint, one server shared by the test files of a pytest process, and more servers that compile nothing
twice (a persistent compilation cache shared by every server of the run)."""

from __future__ import annotations

import contextlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import run_wide_directory
from jax.experimental.compilation_cache import compilation_cache
from served import DEMO_SERVER_ENV, DEMO_SERVER_FLAGS, started

from ling_jax import load_hf_checkpoint, load_model_config
from ling_jax.generation.cli import DEMO_DIR
from ling_jax.generation.generator import Generator
from ling_jax.generation.sampling import SamplingParams
from ling_jax.generation.tokenizer import load_tokenizer
from ling_jax.policy import ExecutionPolicy, FP8Matmul

BATCH_INVARIANT = ExecutionPolicy(fp8_matmul=FP8Matmul.WEIGHT_ONLY)


@pytest.fixture(scope="module")
def demo_model():
    """The demo checkpoint in the batch-invariant mode (`fp8_matmul="weight_only"`, ling-serve's `--fp8-matmul
    weight_only`), in which a served request equals the request run alone on every backend: under the default
    (auto) a GPU multiplies prefill-sized calls in W8A8, so a token's output depends on its call's rows."""
    return load_hf_checkpoint(DEMO_DIR, dtype=jnp.float32, progress=False, policy=BATCH_INVARIANT)


@nnx.jit
def _log_probs_TV(model, ids_T):
    return jax.nn.log_softmax(model(ids_T[None]).logits[0].astype(jnp.float32))


@pytest.fixture(scope="module")
def demo_forward(demo_model, tmp_path_factory):
    """demo_forward(ids) -> [L, V] float32 log-softmax of the demo model's logits at each position: one compiled
    forward pass per length (the model run op by op compiled each op anew for every length, ~5x the time), once a
    run (`reference_compile_cache`: `greedy`'s length is the same in each file)."""
    compile_cache = reference_compile_cache(tmp_path_factory)

    def forward(ids) -> np.ndarray:
        with persistent_compile_cache(compile_cache):
            return np.asarray(_log_probs_TV(demo_model, jnp.asarray(ids, jnp.int32)))

    return forward


# A prompt of two prefill chunks of 16 and its greedy continuation's length, for the logprobs checks
LOGPROBS_PROMPT = "It is a truth universally acknowledged, that a single man"
LOGPROBS_MAX_TOKENS = 4
LOGPROBS_TOLERANCE = 1e-4  # relative or absolute, per value


def logprobs_close(got, expected) -> bool:
    return np.allclose(got, expected, rtol=LOGPROBS_TOLERANCE, atol=LOGPROBS_TOLERANCE)


@pytest.fixture(scope="module")
def greedy(demo_tokenizer, demo_forward):
    """LOGPROBS_PROMPT's ids and those plus its LOGPROBS_MAX_TOKENS greedy tokens (none is EOS), from forward passes
    over the final length (one compiled program): a position's logits do not depend on the placeholder tokens
    after it."""
    prompt = demo_tokenizer.encode(LOGPROBS_PROMPT)
    ids = prompt + [0] * LOGPROBS_MAX_TOKENS
    for position in range(len(prompt), len(ids)):
        ids[position] = int(demo_forward(ids)[position - 1].argmax())
    assert not set(ids[len(prompt) :]) & set(demo_tokenizer.eos_ids)
    return prompt, ids


@pytest.fixture(scope="module")
def greedy_log_probs(greedy, demo_forward):
    """[L, V] log-softmax at each position of the prompt and its greedy tokens, from one forward pass."""
    return demo_forward(greedy[1])


@pytest.fixture(scope="module")
def demo_tokenizer():
    return load_tokenizer(DEMO_DIR, load_model_config(DEMO_DIR))


def reference_compile_cache(tmp_path_factory) -> pathlib.Path:
    """The persistent compilation cache of the references (`Alone`, `demo_forward`), one directory for every
    pytest-xdist worker: the demo model's `Generator` programs (a prefill chunk, the first token, a decode group, per
    sampling features) are the same in each test file that runs requests alone, whatever their prompts and
    max_tokens, and jax drops its compiled programs after each file (tests/conftest.py): a later file (this worker's
    or the other's) reads them instead of compiling them again (the same executables: the same tokens)."""
    return run_wide_directory(tmp_path_factory, "reference-compile-cache")


@contextlib.contextmanager
def persistent_compile_cache(directory: pathlib.Path):
    """JAX's persistent compilation cache in `directory` for the block, every program however quickly it compiled
    (the suite's processes run without one, tests/conftest.py); as it was afterwards."""
    before = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
        compilation_cache.reset_cache()


class Alone:
    """Each request run alone through `Generator` (batch 1), the reference a served request must equal; its
    programs compiled once a run (`reference_compile_cache`)."""

    def __init__(self, model, tokenizer, prefill_chunk: int, compile_cache: pathlib.Path):
        self.generator = Generator(model, prefill_chunk=prefill_chunk)
        self.eos_ids = tokenizer.eos_ids
        self.compile_cache = compile_cache

    def __call__(self, prompt: list[int], sampling: SamplingParams, max_tokens: int) -> list[int]:
        with persistent_compile_cache(self.compile_cache):
            outputs, _ = self.generator.generate([prompt], [sampling], max_tokens, eos_ids=self.eos_ids)
        return outputs[0]


@pytest.fixture(scope="module")
def alone(demo_model, demo_tokenizer, tmp_path_factory):
    """alone(prefill_chunk) -> the `Alone` reference with that chunk (the served engine's)."""
    compile_cache = reference_compile_cache(tmp_path_factory)
    return lambda prefill_chunk: Alone(demo_model, demo_tokenizer, prefill_chunk, compile_cache)


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    """The run's persistent compilation cache for the servers: one directory for all pytest-xdist workers (their
    base temp directories' parent), so a program one server compiled is read by the next with the same flags."""
    return run_wide_directory(tmp_path_factory, "jax-compile-cache")


@pytest.fixture(scope="session")
def start_server(tmp_path_factory, compile_cache):
    """start_server(flags, env=None): a context manager starting `ling-serve` with `flags` (served.started) on the
    run's compile cache; the `Server` it gives answers once `ready()`."""
    return lambda flags, env=None: started(tmp_path_factory.mktemp("serve"), flags, env, compile_cache)


@pytest.fixture(scope="session")
def demo_server(start_server):
    """`ling-serve` on the demo checkpoint with DEMO_SERVER_FLAGS, started once for every test file of this pytest
    process that asks for it (not yet ready: `demo_server.ready()` waits); stopped at the session's end. Tests
    leave it as they found it: idle, and running (a test that stops a server starts its own)."""
    with start_server(DEMO_SERVER_FLAGS, DEMO_SERVER_ENV) as server:
        yield server
