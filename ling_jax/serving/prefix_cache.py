"""Prefix reuse of hybrid state: a radix tree over token ids in blocks of `block` tokens (the prefill chunk).

A node stands for one block of a prompt after its parent's blocks. It holds what a request needs to resume
right after that block: every KDA layer's recurrent state and conv window at the block's end (the chunked
prefill reaches that boundary exactly, so the snapshot is the state a cold prefill has there) and every MLA
layer's latent rows of the block (its page). A request resumes from its longest run of cached blocks: their
pages are copied into its slot's rows, the last node's KDA states into its slot, and its prefill goes on from
there. A prompt that diverges inside a block reuses the blocks before it and recomputes the rest, so nothing
cached is ever written (copy on write is a copy at restore). Only blocks that end before a prompt's last token
are reused: that token's prefill gives the first token's logits.

Memory: each node's device bytes are counted; past `capacity_bytes` the least recently used leaves go first
(a parent outlives its children, so every cached path stays whole).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import jax


@dataclasses.dataclass(eq=False)
class Node:
    block: tuple[int, ...]  # this node's tokens
    parent: Node | None
    kda: tuple = ()  # per KDA layer: the KDAState of one slot ([1, ...] arrays) after this block
    pages: tuple = ()  # per MLA layer: latent rows [1, block, A] of this block
    nbytes: int = 0
    last_used: int = 0
    children: dict[tuple[int, ...], Node] = dataclasses.field(default_factory=dict)
    evicted: bool = False

    @property
    def depth(self) -> int:
        """Blocks from the root to this node, this one included (the root: 0)."""
        return 0 if self.parent is None else self.parent.depth + 1


class PrefixCache:
    def __init__(self, block: int, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"the prefix cache needs a positive size, got {capacity_bytes} bytes")
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

    def insert(self, parent: Node, block: Sequence[int], kda: tuple, pages: tuple) -> Node:
        """The node of `block` after `parent` (a new one holding these snapshots, or the one already cached)."""
        key = tuple(block)
        if len(key) != self.block:
            raise ValueError(f"a prefix-cache block holds {self.block} tokens, got {len(key)}")
        existing = parent.children.get(key)
        if existing is not None or parent.evicted:
            return existing or parent
        nbytes = sum(x.nbytes for x in jax.tree.leaves((kda, pages)))
        node = Node(key, parent, kda, pages, nbytes, next(self._clock))
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
        node.evicted = True
        node.kda = node.pages = ()
        self.nbytes -= node.nbytes

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
            node.evicted, node.kda, node.pages = True, (), ()
        self.root.children.clear()
        self.nbytes = 0
