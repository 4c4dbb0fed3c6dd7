"""The engine's warm-up on the tiny preset: a second start reads every program from the persistent compilation
cache (jax's cache statistics: no miss), and a program still compiling in the background is run around with the
same output (several prompts' prefill rows one at a time; a larger decode bucket; one decode step for several)."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring
from jax.experimental.compilation_cache import compilation_cache

from ling_jax.generation import cli_runtime
from ling_jax.generation.random_init import random_model
from ling_jax.presets import PRESETS
from ling_jax.serving.engine import Engine

CHUNK = 16
CACHE_HIT, CACHE_MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


@pytest.fixture(scope="module")
def tiny_model():
    return random_model(PRESETS["tiny"], dtype=jnp.float32)


def _engine(model) -> Engine:  # two prompts' chunks per prefill step, decode buckets 1 and 2
    return Engine(model, max_batch=2, max_context=64, prefill_chunk=CHUNK, prefill_budget=2 * CHUNK)


@pytest.fixture
def compile_cache(tmp_path, monkeypatch):
    """The entry points' persistent compilation cache, in tmp_path, for this test only."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(cli_runtime.NO_CACHE_ENV, raising=False)
    monkeypatch.delenv(cli_runtime.MIN_COMPILE_TIME_ENV, raising=False)
    before = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    try:
        yield cli_runtime.enable_compile_cache(disabled=False)
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
        compilation_cache.reset_cache()


def test_a_warm_restart_reads_every_program_from_the_cache(tiny_model, compile_cache):
    _engine(tiny_model).warm_up()
    assert len(list(compile_cache.iterdir())) >= 5  # every program, however quickly it compiled
    jax.clear_caches()  # a new process: nothing compiled in memory
    events = Counter()

    def count(event: str, **_) -> None:
        events[event] += 1

    monitoring.register_event_listener(count)
    try:
        _engine(tiny_model).warm_up()
    finally:
        monitoring.unregister_event_listener(count)
    assert events[CACHE_MISS] == 0 and events[CACHE_HIT] >= 5, events


def test_programs_compiling_in_the_background_are_run_around(tiny_model):
    engine = _engine(tiny_model)
    engine.warm_up()
    rng = np.random.default_rng(0)
    chunks = [
        (rng.integers(0, tiny_model.config.vocab_size, CHUNK, dtype=np.int32), np.ones(CHUNK, bool)) for _ in "ab"
    ]
    for slot in (0, 1):
        engine.assign(slot, [], CHUNK + 4)  # room for a decode step after the chunk
    together_PD = engine.prefill([0, 1], chunks, [True, True])
    engine._background[("prefill", CHUNK, 2)] = Future()  # still compiling: one row at a time
    apart_PD = engine.prefill([0, 1], chunks, [True, True])
    np.testing.assert_allclose(np.asarray(apart_PD), np.asarray(together_PD), rtol=1e-5, atol=1e-5)
    active_B = np.array([True, False])
    assert engine.decode_rows(active_B) == 1
    engine._background[("step", 1, 1)] = Future()
    assert engine.compiling() and engine.decode_rows(active_B) == 2
    engine._background[("step", 2, 3)] = Future()  # several steps per program: one step until compiled
    assert np.asarray(engine.decode(active_B, steps=3).counts_B).tolist() == [1, 0]
