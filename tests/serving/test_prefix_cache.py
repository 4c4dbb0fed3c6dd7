"""The prefix cache's radix tree on the host: its LRU eviction keeps it within its size and gives evicted pages back.
Prefix reuse of hybrid state in the engine (cached KDA states and MLA pages shared in place, the tokens of an empty
cache, no page leaked, eviction changing no token): tests/serving/test_scheduler.py, on its engine."""

from __future__ import annotations

import pytest

from ling_jax.serving.pages import PagePool
from ling_jax.serving.prefix_cache import PrefixCache


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
