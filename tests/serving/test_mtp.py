"""MTP speculation per slot (`Engine(mtp=2)`, `ling-serve --mtp 2`) on the demo checkpoint, which has an MTP
layer, with the prefix cache on: more requests than slots, mixed prompt lengths, greedy and seeded sampling, each
output equal to the request run alone through `Generator` without MTP (what the server gives with --mtp 0,
test_scheduler; `Generator(mtp=K)` gives it too, tests/generation/test_generate.py), drafts both accepted and
rejected; a max_tokens or EOS cut inside a step's accepted run streams no token past it; requests resumed from
cached prefixes (KDA states, MLA pages and MTP entries) give the tokens they give with an empty cache; no slot or
page is left taken. One engine, so its programs compile once; the reference is test_scheduler's (compiled once
per process)."""

from __future__ import annotations

import numpy as np
import pytest

from ling_jax.serving.engine import GREEDY, Engine
from ling_jax.serving.prefix_cache import PrefixCache
from ling_jax.serving.scheduler import Finish, Request, Scheduler
from tests.serving.test_prefix_cache import CASES as PREFIX_CASES
from tests.serving.test_scheduler import BUDGET, CASES, CHUNK, MAX_BATCH, MAX_CONTEXT

MTP, PAGE, CACHE_BYTES = 2, 8, 1 << 22


@pytest.fixture(scope="module")
def scheduler(demo_model, demo_tokenizer):
    engine = Engine(
        demo_model,
        max_batch=MAX_BATCH,
        max_context=MAX_CONTEXT,
        prefill_chunk=CHUNK,
        prefill_budget=BUDGET,
        page_size=PAGE,
        prefix_cache_bytes=CACHE_BYTES,
        mtp=MTP,
    )
    engine.warm_up()
    cache = PrefixCache(engine.pages, CHUNK, CACHE_BYTES)
    return Scheduler(engine, demo_tokenizer, eos_ids=demo_tokenizer.eos_ids, max_queue=8, prefix_cache=cache)


def _run(scheduler: Scheduler, cases, sinks=None) -> list[Request]:
    sinks = sinks or [[] for _ in cases]
    requests = [Request(prompt=p, sampling=s, max_tokens=m, emit=sink.append) for (p, s, m), sink in zip(cases, sinks)]
    for request in requests:
        scheduler.submit(request)
    for _ in range(200):
        if not scheduler.waiting and not any(scheduler.slots):
            return requests
        scheduler._step()
    raise AssertionError("still busy after 200 steps")


def _assert_all_free(scheduler: Scheduler) -> None:
    scheduler.prefix_cache.clear()
    pool = scheduler.engine.pages
    assert scheduler.slots == [None] * MAX_BATCH and not scheduler.waiting and pool.free == pool.num_pages
    assert scheduler.engine._params == [GREEDY] * MAX_BATCH


def _counter(scheduler: Scheduler, name: str) -> float:
    return scheduler.metrics.registry.get_sample_value(f"ling_serve_{name}_total")


def test_each_request_equals_plain_decoding_alone(scheduler, alone, demo_tokenizer):
    sinks = [[] for _ in CASES]
    requests = _run(scheduler, CASES, sinks)
    reference = alone(CHUNK)
    for case, request, sink in zip(CASES, requests, sinks):
        expected = reference(*case)
        assert request.tokens == expected, case
        assert [t for d in sink for t in d.token_ids] == expected
        assert "".join(d.text for d in sink) == demo_tokenizer.decode(expected)
    assert 0 < _counter(scheduler, "mtp_accepted_tokens") < _counter(scheduler, "mtp_draft_tokens")
    engine = scheduler.engine  # each slot's MTP entries end where its tokens do (prefill chunks ran between steps)
    np.testing.assert_array_equal(engine.drafts.cache.lengths, engine.cache.lengths)
    _assert_all_free(scheduler)


def test_a_cut_inside_an_accepted_run_streams_nothing_past_it(scheduler, demo_tokenizer, monkeypatch):
    counts = []  # each decode step's tokens per slot
    decode = scheduler.engine.decode

    def recording(active_B):
        tokens_BT, counts_B = decode(active_B)
        counts.append(counts_B)
        return tokens_BT, counts_B

    monkeypatch.setattr(scheduler.engine, "decode", recording)
    prompt = CASES[0][0]
    (request,) = _run(scheduler, [(prompt, GREEDY, 24)])
    full, runs = request.tokens, [1] + [int(c[request.slot]) for c in counts]
    starts = {sum(runs[:i]) for i in range(len(runs))}
    # a token inside a run of several (not its first), seen nowhere before it
    cut = next(i for i in range(1, len(full)) if i not in starts and full.index(full[i]) == i)
    sink = []
    (limited,) = _run(scheduler, [(prompt, GREEDY, cut)], [sink])
    assert limited.tokens == [t for d in sink for t in d.token_ids] == full[:cut] and sink[-1].finish is Finish.LENGTH
    eos = Scheduler(scheduler.engine, demo_tokenizer, eos_ids=[full[cut]], max_queue=8)
    sink = []
    (stopped,) = _run(eos, [(prompt, GREEDY, 24)], [sink])
    assert stopped.tokens == [t for d in sink for t in d.token_ids] == full[:cut] and sink[-1].finish is Finish.STOP
    _assert_all_free(scheduler)


def _mtp_entries(engine: Engine, slot: int) -> np.ndarray:
    return np.asarray(engine.drafts.cache.layer.latent[slot, : int(engine.drafts.cache.lengths[slot])])


def test_prefix_hits_with_mtp_equal_cold_requests(scheduler):
    """Tokens, and each request's MTP entries at its end: the resumed ones (cached blocks' entries restored) are
    the cold ones."""
    cases = [(prompt, sampling, 6) for prompt, sampling, _ in PREFIX_CASES]
    cold, cold_entries = [], []
    for case in cases:
        scheduler.prefix_cache.clear()
        (request,) = _run(scheduler, [case])
        cold.append(request.tokens)
        cold_entries.append(_mtp_entries(scheduler.engine, request.slot))
    scheduler.prefix_cache.clear()
    hits = _counter(scheduler, "prefix_cache_hits")
    warm = _run(scheduler, cases[:1]) + _run(scheduler, cases[1:])
    assert [r.tokens for r in warm] == cold and _counter(scheduler, "prefix_cache_hits") == hits + 3
    for request, entries in zip(warm[1:], cold_entries[1:]):
        np.testing.assert_allclose(_mtp_entries(scheduler.engine, request.slot), entries, atol=1e-4)
    _assert_all_free(scheduler)
