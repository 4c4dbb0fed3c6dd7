"""The MLA page pool's bookkeeping, on the host: which pages are free and how many holders each page has.

A holder is a slot whose page table lists the page, or a prefix-cache node whose block it holds. A page is
free once its last holder lets it go; pages shared by a cached prefix are never written (see `prefix_cache`).
"""

from __future__ import annotations

from collections.abc import Iterable


class PagePool:
    def __init__(self, num_pages: int, page_size: int, page_bytes: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self.page_bytes = page_bytes  # one page id's device bytes, every MLA layer's page together
        self._free = list(range(num_pages - 1, -1, -1))  # popped from the end: lowest ids first
        self._holders = [0] * num_pages

    def pages_for(self, tokens: int) -> int:
        """Pages that hold `tokens` slots."""
        return -(-tokens // self.page_size)

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` free pages, each with one holder (the caller)."""
        if count > len(self._free):  # the pool is sized so that this never happens (`Engine`)
            raise RuntimeError(f"the page pool is exhausted: {count} pages asked, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        self.share(pages)
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """One more holder of each of `pages`."""
        for page in pages:
            self._holders[page] += 1

    def release(self, pages: Iterable[int]) -> None:
        """One holder fewer of each of `pages`; those left with none are free."""
        for page in pages:
            self._holders[page] -= 1
            if not self._holders[page]:
                self._free.append(page)

    def holders(self, page: int) -> int:
        return self._holders[page]
