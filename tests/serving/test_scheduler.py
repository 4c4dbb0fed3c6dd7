"""The scheduler and engine in-process on the demo checkpoint, with the prefix cache (prompts chunked on blocks; the
left-padded layout without it: tests/serving/test_server.py's demo server, test_sampling_controls.py's forks): more
requests than slots, mixed prompt lengths (one and several prefill chunks), greedy and seeded sampling; each output
equals the request run alone through `Generator`, no slot is left taken, and a cancelled request frees its slot at
the next step.

Prefix reuse of hybrid state: requests sharing a system prompt (one diverging inside a cached block, one inside a
page of the second block, one ending on a block boundary) resume from cached KDA states and the cached MLA pages,
shared in place, and give exactly the tokens they give with an empty cache; no page is leaked; a cache smaller than
the prompts evicts and changes no token (the radix tree's LRU eviction alone: tests/serving/test_prefix_cache.py).

MTP speculation per slot (`Engine(mtp=2)`, `ling-serve --mtp 2`; the demo checkpoint has an MTP layer), on an
engine of its own with the same prefix cache, against the same `Generator` references: the same requests give the same
outputs as without MTP (as `Generator(mtp=K)` does, tests/generation/test_generate.py), drafts both accepted and
rejected; a max_tokens or EOS cut inside a step's accepted run streams no token past it; requests resumed from
cached prefixes (KDA states, MLA pages and MTP entries) give the tokens and MTP entries they give with an empty
cache, whatever their slots held before; a prompt's and its greedy tokens' logprobs (the prefix cache's prompt
layout: right-padded chunks) equal the log-softmax of the model's logits over the same tokens; no slot or page is
left taken."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gpu_test

from ling_jax.cache import KDAState
from ling_jax.generation.sampling import SamplingParams
from ling_jax.serving.engine import GREEDY, Engine, decode_buckets, prefix_block_bytes
from ling_jax.serving.prefix_cache import PrefixCache
from ling_jax.serving.scheduler import Finish, QueueFull, Request, Scheduler
from tests.serving.conftest import LOGPROBS_MAX_TOKENS, logprobs_close

MAX_BATCH, MAX_CONTEXT, CHUNK, BUDGET = 2, 96, 16, 32  # two prompts' chunks per prefill step
MTP, PAGE, CACHE_BYTES = 2, 8, 1 << 22  # prefix blocks of CHUNK tokens: two pages each
CASES = [  # (prompt ids, sampling, max_tokens)
    ([5, 17, 300, 42, 9, 1000, 77], GREEDY, 9),
    (list(range(100, 141)), SamplingParams(temperature=0.8, top_p=0.9, seed=3), 7),  # three chunks: 16 + 16 + 16
    ([400, 12, 13], SamplingParams(temperature=1.0, top_k=20, repetition_penalty=1.3, seed=11), 5),
    (list(range(2000, 2019)), SamplingParams(temperature=0.7, min_p=0.05, seed=5), 8),  # two chunks
    ([33, 34], GREEDY, 3),
]
SYSTEM = list(range(300, 340))  # 40 tokens: two whole blocks and 8 more
PREFIX_CASES = [  # (prompt, sampling, cached tokens it can resume after once the first one ran)
    (SYSTEM + [5, 6, 7, 8, 9], GREEDY, 0),
    (SYSTEM + [11, 12, 13], SamplingParams(temperature=0.8, top_p=0.9, seed=4), 32),  # diverges inside block 3
    (SYSTEM[:20] + [50] * 10, SamplingParams(temperature=1.0, top_k=30, seed=9), 16),  # in block 2's first page
    (SYSTEM[:32], SamplingParams(temperature=0.0, repetition_penalty=1.3), 16),  # ends on a block boundary
]
PREFIX_MAX_TOKENS = 6


def _scheduler(model, tokenizer, mtp: int) -> Scheduler:
    """A warmed-up engine with the prefix cache (prompts chunked on blocks) and its scheduler."""
    engine = Engine(
        model,
        max_batch=MAX_BATCH,
        max_context=MAX_CONTEXT,
        prefill_chunk=CHUNK,
        prefill_budget=BUDGET,
        page_size=PAGE,
        prefix_cache_bytes=CACHE_BYTES,
        mtp=mtp,
    )
    engine.warm_up()
    cache = PrefixCache(engine.pages, CHUNK, CACHE_BYTES)
    return Scheduler(engine, tokenizer, eos_ids=tokenizer.eos_ids, max_queue=8, prefix_cache=cache)


@pytest.fixture(scope="module")
def scheduler(demo_model, demo_tokenizer):
    """Plain decoding; one engine for the scheduler's and the prefix cache's tests, so it compiles once."""
    return _scheduler(demo_model, demo_tokenizer, mtp=0)


@pytest.fixture(scope="module")
def references(alone) -> list[list[int]]:
    """Each case's tokens run alone through `Generator` (computed once: three tests compare with them)."""
    reference = alone(CHUNK)
    return [reference(*case) for case in CASES]


def _request(case, sink: list) -> Request:
    prompt, sampling, max_tokens = case
    return Request(prompt=prompt, sampling=sampling, max_tokens=max_tokens, emit=sink.append)


def _run_until_idle(scheduler: Scheduler, limit: int = 200) -> int:
    for step in range(limit):
        if not scheduler.waiting and not any(scheduler.slots):
            return step
        scheduler._step()
    raise AssertionError(f"still busy after {limit} steps")


def test_more_requests_than_slots_each_equal_alone(scheduler, references, demo_tokenizer, monkeypatch):
    """Also: each decode step ran the smallest bucket holding its active slots, and the steps ran buckets both
    below --max-batch and with an idle slot under an active one."""
    engine, steps = scheduler.engine, []
    decode_rows = engine.decode_rows

    def recording(active_B):
        steps.append((tuple(active_B), decode_rows(active_B)))
        return steps[-1][1]

    monkeypatch.setattr(engine, "decode_rows", recording)
    before = {name: _counter(scheduler, name) for name in ("prefill_steps", "prefill_tokens", "prompt_tokens")}
    _check_each_equals_alone(scheduler, references, demo_tokenizer)
    ran = {name: _counter(scheduler, name) - value for name, value in before.items()}
    assert 0 < ran["prefill_steps"] and 0 < ran["prompt_tokens"] <= ran["prefill_tokens"]  # chunks with their pads
    assert all(rows == max(np.flatnonzero(active)) + 1 for active, rows in steps)
    assert any(rows < MAX_BATCH for _, rows in steps)
    assert any(not all(active[:rows]) for active, rows in steps)


def test_decode_buckets():
    assert decode_buckets(1) == [1] and decode_buckets(3) == [1, 2, 3] and decode_buckets(5) == [1, 2, 4, 5]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 64]


@gpu_test("the serving engine over the GPU kernels (Pallas KDA / MLA decode, fused MoE)")
def test_on_the_gpu_each_equals_alone(demo_model, demo_tokenizer, references):
    engine = Engine(
        demo_model, max_batch=MAX_BATCH, max_context=MAX_CONTEXT, prefill_chunk=CHUNK, prefill_budget=BUDGET
    )
    engine.warm_up()
    scheduler = Scheduler(engine, demo_tokenizer, eos_ids=demo_tokenizer.eos_ids, max_queue=8)
    _check_each_equals_alone(scheduler, references, demo_tokenizer)


def _check_each_equals_alone(scheduler, references, demo_tokenizer):
    sinks = [[] for _ in CASES]
    requests = [_request(case, sink) for case, sink in zip(CASES, sinks)]
    for request in requests:
        scheduler.submit(request)
    _run_until_idle(scheduler)
    for case, request, sink, expected in zip(CASES, requests, sinks, references):
        assert request.tokens == expected, case
        assert [t for d in sink for t in d.token_ids] == expected
        assert sink[-1].finish in (Finish.LENGTH, Finish.STOP) and all(d.finish is None for d in sink[:-1])
        assert "".join(d.text for d in sink) == demo_tokenizer.decode(expected)
    assert scheduler.slots == [None] * MAX_BATCH and not scheduler.waiting
    assert scheduler.engine._params == [GREEDY] * MAX_BATCH  # every slot released


def test_cancelled_request_frees_its_slot_at_the_next_step(scheduler):
    sink = []
    request = _request((list(range(50, 60)), GREEDY, 40), sink)
    scheduler.submit(request)
    while len(request.tokens) < 3:
        scheduler._step()
    scheduler.cancel(request)
    scheduler._step()
    assert request.slot is not None and scheduler.slots[request.slot] is None
    assert sink[-1].finish is Finish.CANCELLED and len(request.tokens) < 10


def test_full_queue_is_refused(scheduler):
    requests = [_request(([7, 8, 9], GREEDY, 1), []) for _ in range(MAX_BATCH + scheduler.max_queue)]
    for request in requests:
        scheduler.submit(request)
    with pytest.raises(QueueFull, match="queue is full"):
        scheduler.submit(_request(([7, 8, 9], GREEDY, 1), []))
    with pytest.raises(ValueError, match="got 90 prompt tokens and max_tokens 7"):
        scheduler.submit(_request(([7] * 90, GREEDY, 7), []))
    _run_until_idle(scheduler)
    assert all(len(r.tokens) == 1 for r in requests)


@pytest.fixture(scope="module")
def mtp_scheduler(demo_model, demo_tokenizer):
    """MTP drafts; one engine, so it compiles once."""
    return _scheduler(demo_model, demo_tokenizer, mtp=MTP)


def _run(scheduler: Scheduler, cases, sinks=None) -> list[Request]:
    sinks = sinks or [[] for _ in cases]
    requests = [_request(case, sink) for case, sink in zip(cases, sinks)]
    for request in requests:
        scheduler.submit(request)
    _run_until_idle(scheduler)
    return requests


def _assert_mtp_all_free(scheduler: Scheduler) -> None:
    scheduler.prefix_cache.clear()
    pool = scheduler.engine.pages
    assert scheduler.slots == [None] * MAX_BATCH and not scheduler.waiting and pool.free == pool.num_pages
    assert scheduler.engine._params == [GREEDY] * MAX_BATCH


def _counter(scheduler: Scheduler, name: str) -> float:
    return scheduler.metrics.registry.get_sample_value(f"ling_serve_{name}_total")


def test_mtp_each_request_equals_plain_decoding_alone(mtp_scheduler, references, demo_tokenizer):
    sinks = [[] for _ in CASES]
    requests = _run(mtp_scheduler, CASES, sinks)
    for case, request, sink, expected in zip(CASES, requests, sinks, references):
        assert request.tokens == expected, case
        assert [t for d in sink for t in d.token_ids] == expected
        assert "".join(d.text for d in sink) == demo_tokenizer.decode(expected)
    assert 0 < _counter(mtp_scheduler, "mtp_accepted_tokens") < _counter(mtp_scheduler, "mtp_draft_tokens")
    engine = mtp_scheduler.engine  # each slot's MTP entries end where its tokens do (prefill chunks ran between steps)
    np.testing.assert_array_equal(engine.state.drafts.cache.lengths, engine.state.cache.lengths)
    _assert_mtp_all_free(mtp_scheduler)


def test_mtp_cut_inside_an_accepted_run_streams_nothing_past_it(mtp_scheduler, demo_tokenizer, monkeypatch):
    counts = []  # each decode step's tokens per slot
    decode = mtp_scheduler.engine.decode

    def recording(active_B, **kwargs):
        new = decode(active_B, **kwargs)
        counts.append(new.counts_B)
        return new

    monkeypatch.setattr(mtp_scheduler.engine, "decode", recording)
    prompt = CASES[0][0]
    (request,) = _run(mtp_scheduler, [(prompt, GREEDY, 24)])
    full, runs = request.tokens, [1] + [int(c[request.slot]) for c in counts]
    starts = {sum(runs[:i]) for i in range(len(runs))}
    # a token inside a run of several (not its first), seen nowhere before it
    cut = next(i for i in range(1, len(full)) if i not in starts and full.index(full[i]) == i)
    sink = []
    (limited,) = _run(mtp_scheduler, [(prompt, GREEDY, cut)], [sink])
    assert limited.tokens == [t for d in sink for t in d.token_ids] == full[:cut] and sink[-1].finish is Finish.LENGTH
    # the slot stopped on the device at max_tokens: the step dispatched before its end was seen left it there
    state = mtp_scheduler.engine.state
    assert state.cache.lengths[limited.slot] == state.drafts.cache.lengths[limited.slot] == len(prompt) + cut - 1
    eos = Scheduler(mtp_scheduler.engine, demo_tokenizer, eos_ids=[full[cut]], max_queue=8)
    sink = []
    (stopped,) = _run(eos, [(prompt, GREEDY, 24)], [sink])
    assert stopped.tokens == [t for d in sink for t in d.token_ids] == full[:cut] and sink[-1].finish is Finish.STOP
    # and on the device at its EOS (never fed back): the step dispatched before its end was seen left it there
    state = mtp_scheduler.engine.state
    assert state.cache.lengths[stopped.slot] == state.drafts.cache.lengths[stopped.slot] == len(prompt) + cut
    _assert_mtp_all_free(mtp_scheduler)


def _slot_state(engine: Engine, slot: int) -> list[np.ndarray]:
    """Every array of the slot's state on the host: KDA states, MLA pages, length, seen and counted tokens, token,
    step, and the MTP state (its whole cache row, the next draft, hidden and carry)."""
    state, drafts = engine.state, engine.state.drafts
    pages = np.array([p for p in engine.page_table_BN[slot] if p < engine.pages.num_pages])
    arrays = []
    for s in state.cache.layers:
        arrays += [s.recurrent_state[slot], s.conv_window[slot]] if isinstance(s, KDAState) else [s.latent_pages[pages]]
    rows = [state.cache.lengths, state.seen_BV, state.counts_BV, state.token_B, state.steps_B]
    rows += [drafts.cache.layer.latent, drafts.cache.lengths, drafts.draft_B, drafts.draft_hidden_BD, drafts.carry_BD]
    return [np.asarray(x) for x in arrays + [r[slot] for r in rows]]


def test_mtp_step_leaves_an_idle_slot_bit_for_bit(mtp_scheduler):
    """A speculative round of slot 1 leaves slot 0 (a request mid-decode, not in the step but in its bucket) bit for
    bit as it was: KDA states, MLA pages, length, seen and counted tokens, token, step, MTP cache and drafts."""
    engine = mtp_scheduler.engine
    prompt = CASES[0][0]
    for slot in (0, 1):
        engine.assign(slot, [], len(prompt) + 12)
        hidden_1D = engine.prefill([slot], engine.prompt_chunks(prompt), [True])
        engine.first_token(slot, hidden_1D, GREEDY)
    engine.decode(np.array([True, True]))
    idle = _slot_state(engine, 0)
    stepped = _slot_state(engine, 1)
    new = engine.decode(np.array([False, True]))
    assert int(new.counts_B[0]) == 0 and int(new.counts_B[1]) >= 1
    assert all(a.tobytes() == b.tobytes() for a, b in zip(_slot_state(engine, 0), idle))
    assert _slot_state(engine, 1)[0].tobytes() != stepped[0].tobytes()  # slot 1's first KDA state moved on
    engine.release(0)
    engine.release(1)
    _assert_mtp_all_free(mtp_scheduler)


def _mtp_entries(engine: Engine, slot: int) -> np.ndarray:
    mtp_cache = engine.state.drafts.cache
    return np.asarray(mtp_cache.layer.latent[slot, : int(mtp_cache.lengths[slot])])


def _scramble(engine: Engine, seed: int) -> None:
    """Every float the slots hold (KDA states, MLA pages, MTP entries, carries, draft hiddens) noise, as if other
    requests had left it there (no slot or page in use)."""
    leaves, treedef = jax.tree.flatten(engine.state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noise = [
        jax.random.normal(key, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
        for key, x in zip(keys, leaves)
    ]
    engine.state = engine._place(jax.tree.unflatten(treedef, noise))


def test_mtp_prefix_hits_equal_cold_requests(mtp_scheduler):
    """Tokens, and each request's MTP entries at its end: the resumed ones (cached blocks' entries restored) are
    the cold ones, whatever their slots held before (each run starts from other leftovers)."""
    cases = [(prompt, sampling, PREFIX_MAX_TOKENS) for prompt, sampling, _ in PREFIX_CASES]
    cold, cold_entries = [], []
    for seed, case in enumerate(cases):
        mtp_scheduler.prefix_cache.clear()
        _scramble(mtp_scheduler.engine, seed)
        (request,) = _run(mtp_scheduler, [case])
        cold.append(request.tokens)
        cold_entries.append(_mtp_entries(mtp_scheduler.engine, request.slot))
    mtp_scheduler.prefix_cache.clear()
    _scramble(mtp_scheduler.engine, len(cases))
    hits = _counter(mtp_scheduler, "prefix_cache_hits")
    warm, warm_entries = [], []  # the first one, then the others resumed side by side, a slot each
    for group in [cases[:1]] + [cases[i : i + MAX_BATCH] for i in range(1, len(cases), MAX_BATCH)]:
        warm += _run(mtp_scheduler, group)
        warm_entries += [_mtp_entries(mtp_scheduler.engine, request.slot) for request in warm[-len(group) :]]
    assert [r.tokens for r in warm] == cold and _counter(mtp_scheduler, "prefix_cache_hits") == hits + 3
    for entries, cold_ones in zip(warm_entries[1:], cold_entries[1:]):
        np.testing.assert_allclose(entries, cold_ones, atol=1e-4)
    _assert_mtp_all_free(mtp_scheduler)


def test_mtp_and_prefix_layout_logprobs_equal_the_forward_pass(mtp_scheduler, greedy, greedy_log_probs):
    prompt, ids = greedy
    mtp_scheduler.prefix_cache.clear()
    sink = []
    sampling = SamplingParams(temperature=0.0, logprobs=2)
    mtp_scheduler.submit(Request(prompt, sampling, LOGPROBS_MAX_TOKENS, sink.append, prompt_logprobs=True))
    _run_until_idle(mtp_scheduler)
    assert [t for delta in sink for t in delta.token_ids] == ids[len(prompt) :]
    generated = [e for delta in sink for e in delta.logprobs]
    for first, entries in ((1, sink[0].prompt_logprobs), (len(prompt), generated)):
        assert [e.token for e in entries] == ids[first : first + len(entries)]
        assert first + len(entries) == (len(prompt) if first == 1 else len(ids))
        for position, entry in zip(range(first, len(ids)), entries):
            row = greedy_log_probs[position - 1]
            assert logprobs_close(entry.logprob, row[entry.token])
            top_ids, top = zip(*entry.top)
            assert logprobs_close(top, np.sort(row)[::-1][:2]) and logprobs_close(top, row[list(top_ids)])
    _assert_mtp_all_free(mtp_scheduler)


def test_decode_groups_each_equal_alone(scheduler, references, demo_tokenizer, monkeypatch):
    """Several decode steps per program (`decode_steps`) once nothing else waits: each request still equals itself
    run alone; one ending inside a program at max_tokens, at EOS or at a stop token id streams nothing past it, and
    the slot stopped on the device at its max_tokens or its end token (the program dispatched before its end was
    seen left it there)."""
    engine, steps = scheduler.engine, []
    decode = engine.decode

    def recording(active_B, **kwargs):
        new = decode(active_B, **kwargs)
        steps.append((kwargs["steps"], np.asarray(new.counts_B)))
        return new

    monkeypatch.setattr(engine, "decode_steps", 4)
    monkeypatch.setattr(engine, "decode", recording)
    _check_each_equals_alone(scheduler, references, demo_tokenizer)
    assert {s for s, _ in steps} == {1, 4}
    prompt = CASES[0][0]
    monkeypatch.setattr(engine, "decode_steps", 1)
    (one_step,) = _run(scheduler, [(prompt, GREEDY, 24)])
    monkeypatch.setattr(engine, "decode_steps", 4)
    first = len(steps)
    (request,) = _run(scheduler, [(prompt, GREEDY, 24)])
    full = request.tokens
    assert full == one_step.tokens  # so each cut below is where --decode-steps 1 ends too
    # the first token, then programs of 4 (token i in the program of tokens 4k + 1 to 4k + 4), then the program
    # dispatched before the end was seen: it runs no step (the slot is at its max_tokens)
    assert [int(c[request.slot]) for _, c in steps[first:]] == [4, 4, 4, 4, 4, 3, 0]
    cut = 7  # inside the second program
    sink = []
    (limited,) = _run(scheduler, [(prompt, GREEDY, cut)], [sink])
    assert limited.tokens == [t for d in sink for t in d.token_ids] == full[:cut] and sink[-1].finish is Finish.LENGTH
    assert scheduler.engine.state.cache.lengths[limited.slot] == len(prompt) + cut - 1
    cut = next(i for i in range(2, len(full)) if i % 4 not in (0, 1) and full.index(full[i]) == i)
    eos = Scheduler(engine, demo_tokenizer, eos_ids=[full[cut]], max_queue=8)
    for ends, stop_ids in ((eos, frozenset()), (scheduler, frozenset({full[cut]}))):  # EOS; a stop token id
        sink, first = [], len(steps)
        stopped = Request(prompt=prompt, sampling=GREEDY, max_tokens=24, emit=sink.append, stop_ids=stop_ids)
        ends.submit(stopped)
        _run_until_idle(ends)
        assert stopped.tokens == [t for d in sink for t in d.token_ids] == full[:cut]
        assert sink[-1].finish is Finish.STOP
        # the slot stopped on the device at its end token (never fed back), inside the program that drew it
        assert sum(int(c[stopped.slot]) for _, c in steps[first:]) == cut
        assert scheduler.engine.state.cache.lengths[stopped.slot] == len(prompt) + cut
    assert scheduler.slots == eos.slots == [None] * MAX_BATCH


def _prefix_hits(scheduler: Scheduler) -> tuple[float, float]:
    return _counter(scheduler, "prefix_cache_hits"), _counter(scheduler, "prefix_cache_hit_tokens")


def _prefix_tokens(scheduler: Scheduler, cases) -> list[list[int]]:
    return [r.tokens for r in _run(scheduler, [(prompt, sampling, PREFIX_MAX_TOKENS) for prompt, sampling, _ in cases])]


@pytest.fixture(scope="module")
def cold(scheduler) -> list[list[int]]:
    """Each prefix case's tokens with an empty cache."""
    hits = _prefix_hits(scheduler)
    tokens = []
    for case in PREFIX_CASES:
        scheduler.prefix_cache.clear()
        tokens += _prefix_tokens(scheduler, [case])
    assert _prefix_hits(scheduler) == hits
    return tokens


def test_prefix_resumed_requests_equal_cold_ones_and_hits_count(scheduler, cold, demo_model):
    scheduler.prefix_cache.clear()
    hits, hit_tokens = _prefix_hits(scheduler)
    warm = _prefix_tokens(scheduler, PREFIX_CASES[:1]) + _prefix_tokens(scheduler, PREFIX_CASES[1:])
    assert warm == cold
    assert _prefix_hits(scheduler) == (hits + 3, hit_tokens + sum(c[2] for c in PREFIX_CASES))
    assert len(scheduler.prefix_cache) == 2  # the system prompt's two whole blocks (the others end in part blocks)
    assert scheduler.slots == [None] * MAX_BATCH
    # what ling-serve's --prefix-cache-gb check counts a block at
    assert scheduler.prefix_cache.nbytes == 2 * prefix_block_bytes(demo_model.config, CHUNK, demo_model.dtype, mtp=0)


def test_a_prefix_hit_shares_the_cached_pages_in_place_and_no_page_leaks(scheduler, cold):
    pool = scheduler.engine.pages
    scheduler.prefix_cache.clear()
    assert pool.free == pool.num_pages
    _prefix_tokens(scheduler, PREFIX_CASES[:1])
    cached = [page for node in scheduler.prefix_cache.match(SYSTEM + [0]) for page in node.pages]
    assert len(cached) == 2 * CHUNK // PAGE and pool.free == pool.num_pages - len(cached)
    prompt, sampling, _ = PREFIX_CASES[1]
    request = _request((prompt, sampling, PREFIX_MAX_TOKENS), [])
    scheduler.submit(request)
    scheduler._step()  # admitted: the cached pages head its page table, held by the cache and by it
    row = scheduler.engine.page_table_BN[request.slot]
    assert row[: len(cached)].tolist() == cached and all(pool.holders(p) == 2 for p in cached)
    assert len(set(row.tolist()) - {pool.num_pages}) == -(-(len(request.prompt) + PREFIX_MAX_TOKENS) // PAGE)
    _run_until_idle(scheduler)
    assert all(pool.holders(p) == 1 for p in cached) and pool.free == pool.num_pages - len(cached)


def test_a_prefix_cache_smaller_than_the_prompts_evicts_and_changes_no_token(scheduler, cold, demo_model, monkeypatch):
    block_bytes = prefix_block_bytes(demo_model.config, CHUNK, demo_model.dtype, mtp=0)
    scheduler.prefix_cache.clear()
    small = PrefixCache(scheduler.engine.pages, CHUNK, block_bytes + 1)  # one block: inserts evict
    monkeypatch.setattr(scheduler, "prefix_cache", small)
    assert _prefix_tokens(scheduler, PREFIX_CASES) == cold  # all at once: resumes and inserts interleave with evictions
    assert len(small) == 1 and small.nbytes == block_bytes
    small.clear()
    assert scheduler.engine.pages.free == scheduler.engine.pages.num_pages  # no page leaked
