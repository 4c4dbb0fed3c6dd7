"""Prefix reuse of hybrid state on the demo checkpoint: requests sharing a system prompt (one diverging inside a
cached block, one inside a page of the second block, one ending on a block boundary) resume from cached KDA
states and the cached MLA pages, shared in place, and give exactly the tokens they give with an empty cache; no
page is leaked; the radix tree's LRU eviction keeps it within its size and gives evicted pages back."""

from __future__ import annotations

import pytest

from ling_jax.generation.sampling import SamplingParams
from ling_jax.serving.engine import GREEDY, Engine, prefix_block_bytes
from ling_jax.serving.pages import PagePool
from ling_jax.serving.prefix_cache import PrefixCache
from ling_jax.serving.scheduler import Request, Scheduler

BLOCK, PAGE, MAX_TOKENS, CACHE_BYTES, SLOTS = 16, 8, 6, 1 << 22, 2
SYSTEM = list(range(300, 340))  # 40 tokens: two whole blocks and 8 more
CASES = [  # (prompt, sampling, cached tokens it can resume after once the first one ran)
    (SYSTEM + [5, 6, 7, 8, 9], GREEDY, 0),
    (SYSTEM + [11, 12, 13], SamplingParams(temperature=0.8, top_p=0.9, seed=4), 32),  # diverges inside block 3
    (SYSTEM[:20] + [50] * 10, SamplingParams(temperature=1.0, top_k=30, seed=9), 16),  # in block 2's first page
    (SYSTEM[:32], SamplingParams(temperature=0.0, repetition_penalty=1.3), 16),  # ends on a block boundary
]


@pytest.fixture(scope="module")
def scheduler(demo_model, demo_tokenizer):
    engine = Engine(
        demo_model, max_batch=SLOTS, max_context=64, prefill_chunk=BLOCK, page_size=PAGE, prefix_cache_bytes=CACHE_BYTES
    )
    engine.warm_up()
    cache = PrefixCache(engine.pages, BLOCK, CACHE_BYTES)
    return Scheduler(engine, demo_tokenizer, eos_ids=demo_tokenizer.eos_ids, max_queue=8, prefix_cache=cache)


def _submit(scheduler: Scheduler, cases) -> list[Request]:
    requests = [Request(prompt=p, sampling=s, max_tokens=MAX_TOKENS, emit=lambda d: None) for p, s, _ in cases]
    for request in requests:
        scheduler.submit(request)
    return requests


def _run(scheduler: Scheduler, cases) -> list[list[int]]:
    requests = _submit(scheduler, cases)
    for _ in range(100):
        if not scheduler.waiting and not any(scheduler.slots):
            return [r.tokens for r in requests]
        scheduler._step()
    raise AssertionError("still busy after 100 steps")


def _counter(scheduler: Scheduler, name: str) -> float:
    return scheduler.metrics.registry.get_sample_value(f"ling_serve_prefix_cache_{name}_total")


@pytest.fixture(scope="module")
def cold(scheduler) -> list[list[int]]:
    """Each case's tokens with an empty cache."""
    tokens = []
    for case in CASES:
        scheduler.prefix_cache.clear()
        tokens += _run(scheduler, [case])
    assert _counter(scheduler, "hits") == _counter(scheduler, "hit_tokens") == 0
    return tokens


def test_resumed_requests_equal_cold_ones_and_hits_count(scheduler, cold, demo_model):
    scheduler.prefix_cache.clear()
    warm = _run(scheduler, CASES[:1]) + _run(scheduler, CASES[1:])
    assert warm == cold
    assert _counter(scheduler, "hits") == 3
    assert _counter(scheduler, "hit_tokens") == sum(c[2] for c in CASES)
    assert len(scheduler.prefix_cache) == 2  # the system prompt's two whole blocks (the others end in part blocks)
    assert scheduler.slots == [None] * SLOTS
    # what ling-serve's --prefix-cache-gb check counts a block at
    assert scheduler.prefix_cache.nbytes == 2 * prefix_block_bytes(demo_model.config, BLOCK, demo_model.dtype, mtp=0)


def test_a_hit_shares_the_cached_pages_in_place_and_no_page_leaks(scheduler, cold):
    pool = scheduler.engine.pages
    scheduler.prefix_cache.clear()
    assert pool.free == pool.num_pages
    _run(scheduler, CASES[:1])
    cached = [page for node in scheduler.prefix_cache.match(SYSTEM + [0]) for page in node.pages]
    assert len(cached) == 2 * BLOCK // PAGE and pool.free == pool.num_pages - len(cached)
    (request,) = _submit(scheduler, CASES[1:2])
    scheduler._step()  # admitted: the cached pages head its page table, held by the cache and by it
    row = scheduler.engine.page_table_BN[request.slot]
    assert row[: len(cached)].tolist() == cached and all(pool.holders(p) == 2 for p in cached)
    assert len(set(row.tolist()) - {pool.num_pages}) == -(-(len(request.prompt) + MAX_TOKENS) // PAGE)
    _run(scheduler, [])
    assert all(pool.holders(p) == 1 for p in cached) and pool.free == pool.num_pages - len(cached)


def test_a_cache_smaller_than_the_prompts_evicts_and_changes_no_token(scheduler, cold):
    node_bytes = scheduler.prefix_cache.nbytes // len(scheduler.prefix_cache)
    scheduler.prefix_cache.clear()
    scheduler.prefix_cache = PrefixCache(scheduler.engine.pages, BLOCK, node_bytes + 1)  # one block: inserts evict
    assert _run(scheduler, CASES) == cold  # all at once: resumes and inserts interleave with evictions
    assert len(scheduler.prefix_cache) == 1 and scheduler.prefix_cache.nbytes == node_bytes
    scheduler.prefix_cache.clear()
    assert scheduler.engine.pages.free == scheduler.engine.pages.num_pages  # no page leaked


def test_lru_eviction_keeps_the_cache_within_its_size():
    pool = PagePool(num_pages=8, page_size=4, page_bytes=128)
    cache = PrefixCache(pool, 4, 3 * pool.page_bytes)

    def insert(parent, block):
        (page,) = pool.allocate(1)  # as a request's slot holds the page it wrote
        node = cache.insert(parent, block, (), [page])
        pool.release([page])  # the request ends: the cache is the page's one holder
        return node

    a = insert(cache.root, [1, 2, 3, 4])
    b = insert(a, [5, 6, 7, 8])
    c = insert(cache.root, [9, 9, 9, 9])
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 0]) == [a, b] and cache.nbytes == 3 * pool.page_bytes
    c_page = c.pages[0]
    d = insert(cache.root, [7, 7, 7, 7])  # over the size: c, the least recently used leaf, goes
    assert c.evicted and not b.evicted and cache.match([9, 9, 9, 9, 0]) == [] and cache.nbytes == 3 * pool.page_bytes
    assert pool.holders(c_page) == 0 and pool.free == 8 - 3  # its page is free again
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8]) == [a]  # a block ending on the prompt's last token is not used
    insert(cache.root, [6, 6, 6, 6])  # b (a leaf, older than d) goes before its parent a
    assert b.evicted and not a.evicted and not d.evicted and len(cache) == 3
    with pytest.raises(ValueError, match="holds 4 tokens"):
        cache.insert(cache.root, [1, 2], (), [])
