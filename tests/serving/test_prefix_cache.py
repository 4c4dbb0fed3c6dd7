"""Prefix reuse of hybrid state on the demo checkpoint: requests sharing a system prompt (one diverging inside a
cached block, one inside the second block, one ending on a block boundary) resume from cached KDA states and
MLA pages and give exactly the tokens they give with an empty cache; the radix tree's LRU eviction keeps it
within its size."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from ling_jax.generation.sampling import SamplingParams
from ling_jax.serving.engine import GREEDY, Engine
from ling_jax.serving.prefix_cache import PrefixCache
from ling_jax.serving.scheduler import Request, Scheduler

BLOCK, MAX_TOKENS = 16, 6
SYSTEM = list(range(300, 340))  # 40 tokens: two whole blocks and 8 more
CASES = [  # (prompt, sampling, cached tokens it can resume after once the first one ran)
    (SYSTEM + [5, 6, 7, 8, 9], GREEDY, 0),
    (SYSTEM + [11, 12, 13], SamplingParams(temperature=0.8, top_p=0.9, seed=4), 32),  # diverges inside block 3
    (SYSTEM[:20] + [50] * 10, SamplingParams(temperature=1.0, top_k=30, seed=9), 16),  # inside block 2
    (SYSTEM[:32], SamplingParams(temperature=0.0, repetition_penalty=1.3), 16),  # ends on a block boundary
]


@pytest.fixture(scope="module")
def scheduler(demo_model, demo_tokenizer):
    engine = Engine(demo_model, max_batch=3, max_context=64, prefill_chunk=BLOCK, prefix_block=BLOCK)
    engine.warm_up()
    cache = PrefixCache(BLOCK, 1 << 30)
    return Scheduler(engine, demo_tokenizer, eos_ids=demo_tokenizer.eos_ids, max_queue=8, prefix_cache=cache)


def _run(scheduler: Scheduler, cases) -> list[list[int]]:
    requests = [Request(prompt=p, sampling=s, max_tokens=MAX_TOKENS, emit=lambda d: None) for p, s, _ in cases]
    for request in requests:
        scheduler.submit(request)
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


def test_resumed_requests_equal_cold_ones_and_hits_count(scheduler, cold):
    scheduler.prefix_cache.clear()
    warm = _run(scheduler, CASES[:1]) + _run(scheduler, CASES[1:])
    assert warm == cold
    assert _counter(scheduler, "hits") == 3
    assert _counter(scheduler, "hit_tokens") == sum(c[2] for c in CASES)
    assert len(scheduler.prefix_cache) == 2  # the system prompt's two whole blocks (the others end in part blocks)
    assert scheduler.prefix_cache.nbytes > 0 and scheduler.slots == [None] * 3


def test_a_cache_smaller_than_the_prompts_evicts_and_changes_no_token(scheduler, cold):
    node_bytes = scheduler.prefix_cache.nbytes // len(scheduler.prefix_cache)
    scheduler.prefix_cache = PrefixCache(BLOCK, node_bytes + 1)  # room for one block: every insert evicts
    assert _run(scheduler, CASES) == cold  # all at once: resumes and inserts interleave with evictions
    assert len(scheduler.prefix_cache) == 1 and scheduler.prefix_cache.nbytes == node_bytes


def test_lru_eviction_keeps_the_cache_within_its_size():
    page = jnp.zeros((1, 4, 8), jnp.float32)  # 128 bytes a node
    cache = PrefixCache(4, 3 * page.nbytes)
    a = cache.insert(cache.root, [1, 2, 3, 4], (), (page,))
    b = cache.insert(a, [5, 6, 7, 8], (), (page,))
    c = cache.insert(cache.root, [9, 9, 9, 9], (), (page,))
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 0]) == [a, b] and cache.nbytes == 3 * page.nbytes
    d = cache.insert(cache.root, [7, 7, 7, 7], (), (page,))  # over the size: c, the least recently used leaf, goes
    assert c.evicted and not b.evicted and cache.match([9, 9, 9, 9, 0]) == [] and cache.nbytes == 3 * page.nbytes
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8]) == [a]  # a block ending on the prompt's last token is not used
    cache.insert(cache.root, [6, 6, 6, 6], (), (page,))  # b (a leaf, older than d) goes before its parent a
    assert b.evicted and not a.evicted and not d.evicted and len(cache) == 3
    with pytest.raises(ValueError, match="holds 4 tokens"):
        cache.insert(cache.root, [1, 2], (), (page,))
