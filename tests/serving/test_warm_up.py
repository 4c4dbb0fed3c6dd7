"""The engine's warm-up on the tiny preset: a second start reads every program from the persistent compilation cache
(jax's cache statistics: no miss; none of them stored in a program store) or, with a filled one, loads the prefill
and decode programs without tracing them (same outputs; another engine's shapes are another key), and a program
still compiling in the background is run around with the same output (several prompts' prefill rows one at a time;
a larger decode bucket; one decode step for several; a long chunk in shorter pieces). Over a mesh (one process,
`ling-serve --mesh expert=4`), the first requests after it compile nothing, as ling-serve's report of each
compilation after `ready` would say (jax's compile event), which a prompt's logprobs (compiled at their first
request) show."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import monitoring
from jax.experimental.compilation_cache import compilation_cache

from ling_jax.generation import cli_runtime
from ling_jax.generation.random_init import random_model
from ling_jax.generation.sampling import SamplingParams
from ling_jax.generation.static_model import StaticModel
from ling_jax.presets import PRESETS
from ling_jax.serving.engine import GREEDY, Engine, _step
from ling_jax.serving.programs import ProgramStore, StoredProgram, spec
from ling_jax.serving.replicated import report_compile
from ling_jax.sharding import make_mesh

CHUNK = 16
CACHE_HIT, CACHE_MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"
TRACE = "/jax/core/compile/jaxpr_trace_duration"


@pytest.fixture(scope="module")
def tiny_model():
    return random_model(PRESETS["tiny"], dtype=jnp.float32)


# The tests run in this order so that the tiny engine's programs compile as few times as they can: the first test's
# second warm-up reads them from the persistent cache into jax's in-memory caches, where the next two tests' engines
# (the same shapes) find them; the stored-program test then clears those caches (a new process) and compiles anew.
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
    store = ProgramStore(compile_cache / "programs")
    try:
        _engine(tiny_model).warm_up(store=store)
    finally:
        monitoring.unregister_event_listener(count)
    assert events[CACHE_MISS] == 0 and events[CACHE_HIT] >= 5, events
    # a program read from the cache is not stored: XLA:CPU would serialise it without its kernels
    assert not store.directory.exists() or not list(store.directory.iterdir())


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


def test_plain_greedy_programs_take_over_while_every_slot_is_greedy(tiny_model, monkeypatch):
    """With `plain_greedy_programs` (a GPU's default) the warm-up also compiles each decode program traced for plain
    greedy sampling (no conditional); `decode` runs it while every slot samples greedily and gives the general
    program's tokens, and the general one as soon as a slot samples otherwise."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, tiny_model.config.vocab_size, CHUNK, dtype=np.int32) for _ in "ab"]
    served, keys = [], []
    for plain in (True, False):
        engine = Engine(tiny_model, max_batch=2, max_context=64, prefill_chunk=CHUNK, plain_greedy_programs=plain)
        if plain:
            engine.warm_up()
            assert {("plain", 1, 1), ("plain", 2, 1)} <= set(engine._background)
        run = engine._run
        monkeypatch.setattr(engine, "_run", lambda key, fn, args: keys.append((plain, key[0])) or run(key, fn, args))
        for slot, ids_C in enumerate(prompts):
            engine.assign(slot, [], CHUNK + 8)
            engine.first_token(slot, engine.prefill([slot], [(ids_C, np.ones(CHUNK, bool))], [True]), GREEDY)
        served.append([np.asarray(engine.decode(np.array([True, True])).tokens_BT) for _ in range(3)])
    np.testing.assert_array_equal(*served)
    assert [kind for plain, kind in keys if plain and kind != "prefill"] == ["plain"] * 3
    assert [kind for plain, kind in keys if not plain and kind != "prefill"] == ["step"] * 3
    engine.release(1)  # the general engine's slot 1 now samples: then the plain engine's would run the general program
    engine.plain_greedy_programs = True
    engine._background = {("plain", 2, 1): Future()}
    engine._background[("plain", 2, 1)].set_result(None)
    engine.assign(1, [], CHUNK + 8)
    sampled = SamplingParams(temperature=0.7, seed=3)
    engine.first_token(1, engine.prefill([1], [(prompts[1], np.ones(CHUNK, bool))], [True]), sampled)
    keys.clear()
    engine.decode(np.array([True, True]))
    assert keys == [(False, "step")]
    engine.release(1)  # every slot greedy again: the plain program
    keys.clear()
    engine.decode(np.array([True, False]), rows=2)
    assert keys == [(False, "plain")]


def _prefill_and_decode(engine: Engine, ids_C: np.ndarray):
    engine.assign(0, [], CHUNK + 4)
    hidden_1D = engine.prefill([0], [(ids_C, np.ones(CHUNK, bool))], [True])
    new = engine.decode(np.array([True, False]))
    return np.asarray(hidden_1D), np.asarray(new.tokens_BT)


def test_a_warm_restart_loads_the_stored_programs_without_tracing(tiny_model, tmp_path):
    jax.clear_caches()  # XLA:CPU cannot serialise a program with a sort once it has run (an earlier test's)
    store = ProgramStore(tmp_path)
    first = _engine(tiny_model)
    first.warm_up(store=store)
    assert len(list(tmp_path.glob("*.program"))) == len(first._programs)
    jax.clear_caches()  # a new process: a program not loaded would be traced again
    traced = Counter()

    def count(event: str, duration: float, fun_name: str = "", **_) -> None:
        traced[fun_name] += event == TRACE

    monitoring.register_event_duration_secs_listener(count)
    try:
        second = _engine(tiny_model)
        second.warm_up(store=store)
        ids_C = np.random.default_rng(0).integers(0, tiny_model.config.vocab_size, CHUNK, dtype=np.int32)
        loaded = _prefill_and_decode(second, ids_C)
    finally:
        monitoring.unregister_event_duration_listener(count)
    assert traced["_prefill"] == traced["_step"] == 0, traced
    assert all(isinstance(future.result(), StoredProgram) for future in second._programs.values())
    for compiled, stored in zip(_prefill_and_decode(first, ids_C), loaded, strict=True):
        np.testing.assert_array_equal(stored, compiled)
    other = Engine(tiny_model, max_batch=3, max_context=64, prefill_chunk=CHUNK, prefill_budget=2 * CHUNK)
    specs = jax.tree.map(spec, first._step_args(np.zeros(2, bool), 2, 1))  # the largest bucket's step program
    twin = StaticModel(first.static.graphdef, first.static.treedef)  # as another process's model: the same key
    assert store.path(_step, (twin, *specs[1:])) == store.path(_step, specs) and store.path(_step, specs).exists()
    # another engine's: another key, nothing loaded
    assert not store.path(_step, jax.tree.map(spec, other._step_args(np.zeros(3, bool), 3, 1))).exists()


def test_a_chunk_whose_program_still_compiles_is_prefilled_in_shorter_pieces(tiny_model):
    engine = Engine(tiny_model, max_batch=2, max_context=128, prefill_chunk=4 * CHUNK)  # chunk lengths 16, 32, 64
    prompt = np.random.default_rng(1).integers(0, tiny_model.config.vocab_size, 104).tolist()
    assert [len(ids) for ids, _ in engine.prompt_chunks(prompt)] == [64, 64]  # the head: 24 pads, then 40 tokens
    served = []
    for compiling in ({}, {("prefill", 2 * CHUNK, 1): Future(), ("prefill", 4 * CHUNK, 1): Future()}):
        engine._background = compiling  # 32 and 64 still compiling: each chunk in pieces of 16, a pad-only one skipped
        engine.assign(0, [], len(prompt) + 4)
        for index, chunk in enumerate(engine.prompt_chunks(prompt)):
            hidden_1D = engine.prefill([0], [chunk], [index == 0])
        first = engine.first_token(0, hidden_1D, GREEDY)
        second = engine.decode(np.array([True, False]))
        served.append((np.asarray(hidden_1D), [int(first.tokens_BT[0, 0]), int(second.tokens_BT[0, 0])]))
        engine.release(0)
    (whole_1D, whole_tokens), (pieces_1D, pieces_tokens) = served
    np.testing.assert_allclose(pieces_1D, whole_1D, rtol=1e-4, atol=1e-4)
    assert pieces_tokens == whole_tokens


def test_over_a_mesh_the_first_requests_compile_nothing(tiny_model, capsys):
    # buckets 1, 2, 4: XLA lays a bucket's rows over the expert axis, where an uncommitted input would be moved by a
    # program of jax's own at the first call (the warm-up compiled the decode programs without calling them)
    mesh = make_mesh({"expert": 4}, devices=jax.devices()[:4])
    engine = Engine(
        nnx.clone(tiny_model), max_batch=4, max_context=64, prefill_chunk=CHUNK, prefill_budget=2 * CHUNK, mesh=mesh
    )
    engine.warm_up()
    rng = np.random.default_rng(2)
    chunks = [
        (rng.integers(0, tiny_model.config.vocab_size, CHUNK, dtype=np.int32), np.ones(CHUNK, bool)) for _ in "abcd"
    ]
    monitoring.register_event_duration_secs_listener(report_compile)
    try:
        for slot in range(4):
            engine.assign(slot, [], CHUNK + 4)
        together_PD = engine.prefill([0, 1], chunks[:2], [True, True])  # the two-row step, its rows taken apart
        engine._background[("prefill", CHUNK, 2)] = Future()  # as while it compiles: one row at a time, put together
        apart_PD = engine.prefill([2, 3], chunks[2:], [True, True])
        for slot, hidden_PD in enumerate([together_PD, together_PD, apart_PD, apart_PD]):
            engine.first_token(slot, hidden_PD[slot % 2 : slot % 2 + 1], SamplingParams(temperature=0.8, seed=slot))
        for active_B in ([True] * 4, [True, False, False, False]):  # buckets 4 and 1
            jax.device_get(engine.decode(np.array(active_B)))
        assert capsys.readouterr().err == ""
        engine.prompt_logprobs(chunks[0][0].tolist())  # by design, compiled at its first request
    finally:
        monitoring.unregister_event_duration_listener(report_compile)
    assert "ling-serve: process 0 compiled jit(_prompt_chunk_logprobs) while serving" in capsys.readouterr().err
