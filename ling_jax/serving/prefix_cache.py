"""Prefix reuse of hybrid state: a radix tree over token ids in blocks of `block` tokens (the prefill chunk).

A node stands for one block of a prompt after its parent's blocks. It holds what a request needs to resume
right after that block: a snapshot of every KDA layer's recurrent state and conv window at the block's end (the
chunked prefill reaches that boundary exactly, so the snapshot is the state a cold prefill has there; with MTP,
also the MTP entries the block's prefill wrote and its carry, `Engine.snapshot`) and the ids of the MLA pages
that hold the block's latent rows (`PagePool`; the node is one of their holders, so they outlive the request
that wrote them). A request resumes from its longest run of cached blocks: their pages
head its page table, shared in place with the cache and every other request reading them, the last node's
KDA states go into its slot, and its prefill goes on from there. Blocks are whole pages, so a request's own
tokens (after the last shared block, where a prompt diverges inside a block included) always go to pages of
its own: a shared page is never written, and copy-on-write never has to copy. Only blocks that end before a
prompt's last token are reused: that token's prefill gives the first token's logits.

Memory: each node's KDA snapshot and pages are counted; past `capacity_bytes` the least recently used leaves go
first (a parent outlives its children, so every cached path stays whole) and give their pages back.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import jax

from ling_jax.serving.pages import PagePool


@dataclasses.dataclass(eq=False)
class Node:
    block: tuple[int, ...]  # this node's tokens
    parent: Node | None
    state: tuple = ()  # the slot's state after this block (`Engine.snapshot`: KDA states; with MTP, MTP entries)
    pages: tuple[int, ...] = ()  # the MLA pages of this block's latent rows, in order
    nbytes: int = 0
    last_used: int = 0
    children: dict[tuple[int, ...], Node] = dataclasses.field(default_factory=dict)
    evicted: bool = False

    @property
    def depth(self) -> int:
        """Blocks from the root to this node, this one included (the root: 0)."""
        return 0 if self.parent is None else self.parent.depth + 1


class PrefixCache:
    def __init__(self, pool: PagePool, block: int, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"the prefix cache needs a positive size, got {capacity_bytes} bytes")
        if block % pool.page_size:
            raise ValueError(f"a prefix block ({block} tokens) must be whole pages of {pool.page_size} tokens")
        self.pool = pool
        self.block = block
        self.capacity_bytes = capacity_bytes
        self.root = Node((), None)
        self.nbytes = 0
        self._clock = itertools.count(1)

    def match(self, prompt: Sequence[int]) -> list[Node]:
        """The cached blocks `prompt` starts with (ending before its last token), root excluded; marks them used."""
        path, node = [], self.root
        for start in range(0, len(prompt) - 1 - self.block + 1, self.block):
            node = node.children.get(tuple(prompt[start : start + self.block]))
            if node is None:
                break
            path.append(node)
        now = next(self._clock)
        for node in path:
            node.last_used = now
        return path

    def insert(self, parent: Node, block: Sequence[int], state: tuple, pages: Sequence[int]) -> Node:
        """The node of `block` after `parent` (a new one holding this snapshot and sharing these pages, or the one
        already cached)."""
        key = tuple(block)
        if len(key) != self.block:
            raise ValueError(f"a prefix-cache block holds {self.block} tokens, got {len(key)}")
        existing = parent.children.get(key)
        if existing is not None or parent.evicted:
            return existing or parent
        self.pool.share(pages)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state)) + len(pages) * self.pool.page_bytes
        node = Node(key, parent, state, tuple(pages), nbytes, next(self._clock))
        parent.children[key] = node
        self.nbytes += nbytes
        self._evict(keep=node)
        return node

    def _evict(self, keep: Node) -> None:
        while self.nbytes > self.capacity_bytes:
            leaves = [n for n in self._nodes() if not n.children and n is not keep]
            if not leaves:
                if keep.parent is not None and not keep.evicted:  # the new node alone is over the budget
                    self._remove(keep)
                return
            self._remove(min(leaves, key=lambda n: n.last_used))

    def _remove(self, node: Node) -> None:
        del node.parent.children[node.block]
        self._drop(node)
        self.nbytes -= node.nbytes

    def _drop(self, node: Node) -> None:
        self.pool.release(node.pages)
        node.evicted, node.state, node.pages = True, (), ()

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def __len__(self) -> int:
        return sum(1 for _ in self._nodes())

    def clear(self) -> None:
        """Drop every cached block (requests holding a node of the old tree cache nothing more under it)."""
        for node in list(self._nodes()):
            self._drop(node)
        self.root.children.clear()
        self.nbytes = 0
