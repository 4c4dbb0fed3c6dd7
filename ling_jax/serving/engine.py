"""The device side of the server: a batch of `max_batch` fixed slots and the jitted programs that run over it.

Each slot holds one request: its rows of a paged `LingCache` (KDA recurrent state and conv window, length, and
its page-table row: the pages of every MLA layer's latent cache that hold its tokens), its row of the repetition
penalty's seen-token mask, its last token and its token count. The MLA pages come from one pool
(`PagePool`, reference counted on the host): a request is given pages for its prompt and completion when it is
admitted, the ones of a cached prefix shared with the prefix cache and the other requests reading them, and
frees them when it ends. The pool holds every slot's worth of pages plus the prefix cache's, so it never runs
out. Three programs, each compiled once per shape and run with the slot batch donated:

- `prefill`: one chunk of each of up to `prefill_rows(C)` requests' prompts (chunks of one length C, as many
  as `prefill_budget` tokens allow; a lone chunk runs as one row) into their slots (a first chunk resets
  its slot). A prompt is laid out as `Generator` lays out a prompt run alone (left-padded to a power-of-two
  head chunk, then full chunks of `prefill_chunk`), so each chunk length compiles once or twice (one row;
  the budget's rows) and each row computes what a batch-1 `Generator.generate` computes;
- `first_token`: the request's first token from its last prompt position;
- `decode`: one decode step of every slot. Slots that are not decoding (free, or between prefill chunks) run
  too, with no pages (they read and write only a scratch page), and keep their KDA states, length, token and
  token count.

Sampling is `ling_jax.generation.sampling.sample`: a row's key is fold_in(key(seed), token index), so a
request's tokens depend on its own seed and position only, never on the other slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.cache import KDAState, LingCache
from ling_jax.checkpoints.pieces import one_device_sharding
from ling_jax.config import MLA
from ling_jax.generation.generator import MIN_CHUNK, prefill_chunks
from ling_jax.generation.sampling import SamplingArrays, SamplingParams, sample, seen_from_prompts, update_seen
from ling_jax.generation.static_model import split_model
from ling_jax.model import LingForCausalLM
from ling_jax.serving.pages import PagePool
from ling_jax.sharding import cache_shardings, shard_model

GREEDY = SamplingParams(temperature=0.0)  # what an idle slot "samples" with: the cheapest branch of `sample`
PAGE_SIZE = 64  # MLA cache slots per page: the Hopper paged decode kernel reads pages of a multiple of 64 in place


def _slot_rows(tree, slot):
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0), tree)


def _put_slot_rows(tree, rows, slot):
    return jax.tree.map(lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r, slot, axis=0), tree, rows)


def _no_page(cache: LingCache) -> int:
    """The scratch page, the device pool's last (one past the `PagePool`'s, never given out): table entries of no
    page name it, so a slot without pages reads and writes only it (in bounds, for kernels reading in place)."""
    return next(s.latent_pages.shape[0] for s in cache.layers if not isinstance(s, KDAState)) - 1


def _gather_rows(cache: LingCache, slots_P) -> LingCache:
    """The slots' rows (slots past the batch: padding rows of zero states and no pages) over the whole pool."""

    def take(x):
        return x.at[slots_P].get(mode="fill", fill_value=0)

    layers = tuple(jax.tree.map(take, s) if isinstance(s, KDAState) else s for s in cache.layers)
    page_table_PN = cache.page_table.at[slots_P].get(mode="fill", fill_value=_no_page(cache))
    return LingCache(layers=layers, lengths=take(cache.lengths), page_table=page_table_PN)


def _scatter_rows(cache: LingCache, rows: LingCache, slots_P) -> LingCache:
    """`cache` with the slots' rows and the pool `rows` holds (padding rows are dropped)."""

    def put(x, r):
        return x.at[slots_P].set(r, mode="drop")

    layers = tuple(jax.tree.map(put, s, r) if isinstance(s, KDAState) else r for s, r in zip(cache.layers, rows.layers))
    return cache.replace(layers=layers, lengths=put(cache.lengths, rows.lengths))


def _reset(rows: LingCache, fresh_P) -> LingCache:
    """Slot rows as a new request finds them where fresh_P: KDA states zero, length 0 (its pages' old contents
    lie past the length, invisible)."""
    layers = tuple(
        jax.tree.map(lambda x: _where_rows(fresh_P, jnp.zeros_like(x), x), s) if isinstance(s, KDAState) else s
        for s in rows.layers
    )
    return rows.replace(layers=layers, lengths=jnp.where(fresh_P, 0, rows.lengths))


def _mark_seen(seen_BV, slots_P, ids_PC, mask_PC, fresh_P):
    """The slots' seen rows with their chunks' real tokens added (cleared first where fresh)."""
    kept_PV = seen_BV.at[slots_P].get(mode="fill", fill_value=False) & ~fresh_P[:, None]
    return seen_BV.at[slots_P].set(seen_from_prompts(ids_PC, mask_PC, seen_BV.shape[1]) | kept_PV, mode="drop")


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(2, 3))
def _prefill(static, leaves, cache: LingCache, seen_BV, slots_P, ids_PC, mask_PC, fresh_P, last_P):
    """One prompt chunk per row [P, C] into slots_P (rows whose slot is past the batch are padding: computed,
    never written); -> (cache, seen, hidden [P, D] at each row's column last_P)."""
    model = static.merge(leaves)
    rows = _reset(_gather_rows(cache, slots_P), fresh_P)
    hidden_PCD, rows = model.model(ids_PC, cache=rows, attention_mask=mask_PC, policy=model.policy)
    cache = _scatter_rows(cache, rows, slots_P)
    seen_BV = _mark_seen(seen_BV, slots_P, ids_PC, mask_PC, fresh_P)
    return cache, seen_BV, hidden_PCD[jnp.arange(ids_PC.shape[0]), last_P]


@jax.jit
def _snapshot(cache: LingCache, slot):
    """The slot's KDA states now (per KDA layer, [1, ...] arrays): with its pages, a prefix-cache node."""
    return tuple(_slot_rows(s, slot) for s in cache.layers if isinstance(s, KDAState))


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _restore(cache: LingCache, seen_BV, slot, kda, ids_1L, mask_1L):
    """Resume the slot after a cached prefix (ids_1L where mask_1L; its pages are in the slot's table row): the
    last block's KDA states, the length, the prefix's tokens marked seen."""
    kda = iter(kda)
    layers = tuple(_put_slot_rows(s, next(kda), slot) if isinstance(s, KDAState) else s for s in cache.layers)
    lengths = cache.lengths.at[slot].set(mask_1L.sum(dtype=jnp.int32))
    seen_BV = _mark_seen(seen_BV, slot[None], ids_1L, mask_1L, jnp.ones((1,), bool))
    return cache.replace(layers=layers, lengths=lengths), seen_BV


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(2, 3, 4))
def _first_token(static, leaves, seen_BV, token_B, steps_B, slot, hidden_1D, arrays_1: SamplingArrays):
    """The request's first token (its token index 0); the slot's token, count and seen row updated."""
    logits_1V = static.merge(leaves).logits(hidden_1D[:, None])[:, 0]
    seen_1V = _slot_rows(seen_BV, slot)
    token_1 = sample(logits_1V, arrays_1, jnp.zeros((1,), jnp.int32), seen_1V)
    seen_BV = _put_slot_rows(seen_BV, update_seen(seen_1V, token_1), slot)
    token_B = _put_slot_rows(token_B, token_1, slot)
    steps_B = _put_slot_rows(steps_B, jnp.ones((1,), jnp.int32), slot)
    return token_1[0], seen_BV, token_B, steps_B


def _where_rows(rows_B, new, old):
    return jnp.where(rows_B.reshape(-1, *([1] * (new.ndim - 1))), new, old)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(2, 3, 4, 5))
def _decode(static, leaves, cache: LingCache, seen_BV, token_B, steps_B, arrays: SamplingArrays, active_B):
    """One decode step of every slot; slots not active have no pages in it (they touch only the scratch page: a
    new request's slot may list shared pages before its first prefill) and keep their KDA states, length, token
    and count."""
    no_pages_BN = jnp.full_like(cache.page_table, _no_page(cache))
    stepping = cache.replace(page_table=jnp.where(active_B[:, None], cache.page_table, no_pages_BN))
    out = static.merge(leaves)(token_B[:, None], cache=stepping)
    next_B = jnp.where(active_B, sample(out.logits[:, 0], arrays, steps_B, seen_BV), token_B)
    layers = tuple(
        jax.tree.map(lambda new, old: _where_rows(active_B, new, old), s, before) if isinstance(s, KDAState) else s
        for s, before in zip(out.cache.layers, cache.layers)
    )
    cache = cache.replace(layers=layers, lengths=jnp.where(active_B, out.cache.lengths, cache.lengths))
    seen_BV = jnp.where(active_B[:, None], update_seen(seen_BV, next_B), seen_BV)
    return next_B, cache, seen_BV, next_B, steps_B + active_B.astype(jnp.int32)


class Engine:
    """The slot batch on the device and the programs over it. Not thread-safe: one scheduler drives it."""

    def __init__(
        self,
        model: LingForCausalLM,
        *,
        max_batch: int,
        max_context: int,
        prefill_chunk: int,
        mesh: jax.sharding.Mesh | None = None,
        prefill_budget: int | None = None,
        page_size: int = PAGE_SIZE,
        prefix_cache_bytes: int = 0,
    ):
        """prefix_cache_bytes: the prefix cache's size (0: none); the pool gets that many bytes of pages more, and
        prompts are chunked on prefix blocks (prefill chunks, whole pages)."""
        if max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
        if prefill_chunk < MIN_CHUNK:
            raise ValueError(f"--prefill-chunk must be >= {MIN_CHUNK}, got {prefill_chunk}")
        limit = model.config.max_position_embeddings
        if not 2 <= max_context <= limit:
            raise ValueError(f"--max-context must be in [2, {limit}] (the model's context), got {max_context}")
        self.config = model.config
        self.max_batch = max_batch
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.prefill_budget = prefill_chunk if prefill_budget is None else prefill_budget
        if self.prefill_budget < prefill_chunk:
            raise ValueError(f"--prefill-budget must be >= --prefill-chunk ({prefill_chunk}), got {prefill_budget}")
        if page_size < 1 or (prefix_cache_bytes and prefill_chunk % page_size):
            raise ValueError(f"--page-size must be >= 1 and divide --prefill-chunk ({prefill_chunk}), got {page_size}")
        # set: prompts are chunked on block boundaries, for the prefix cache
        self.prefix_block = prefill_chunk if prefix_cache_bytes else None
        self.mesh = mesh
        if mesh is not None:
            shard_model(model, mesh)
        self.static, self.leaves = split_model(model)
        mla_layers = sum(kind == MLA for kind in self.config.layer_types)
        page_bytes = mla_layers * page_size * self.config.latent_dim * jnp.dtype(model.dtype).itemsize
        self.pages_per_slot = -(-max_context // page_size)
        num_pages = max_batch * self.pages_per_slot + prefix_cache_bytes // page_bytes
        self.pages = PagePool(num_pages, page_size, page_bytes)
        # the host's copy; num_pages: no page (the device's scratch page)
        self.page_table_BN = np.full((max_batch, self.pages_per_slot), num_pages, np.int32)
        self._table_changed = True  # the device's table (all out of range) becomes the host's at the first program
        self.cache = self._place(
            LingCache.create_paged(self.config, max_batch, num_pages + 1, page_size, self.pages_per_slot, model.dtype)
        )
        replicated = one_device_sharding() if mesh is None else jax.sharding.NamedSharding(mesh, jax.P())
        self.seen_BV = jax.device_put(jnp.zeros((max_batch, self.config.vocab_size), bool), replicated)
        self.token_B = jax.device_put(jnp.zeros((max_batch,), jnp.int32), replicated)
        self.steps_B = jax.device_put(jnp.zeros((max_batch,), jnp.int32), replicated)
        self._params = [GREEDY] * max_batch
        self._arrays: SamplingArrays | None = None  # the device copy of _params, rebuilt after a change

    def _place(self, tree):
        """`tree` committed where the programs keep it (one device, or the cache's shardings over the mesh): an
        uncommitted input would compile each program again once its outputs, committed, come back."""
        if self.mesh is None:
            return jax.device_put(tree, one_device_sharding())
        return jax.device_put(tree, cache_shardings(tree, self.mesh))

    def chunks(self, prompt_length: int) -> list[int]:
        """The chunk lengths a prompt of `prompt_length` tokens is prefilled in (the last chunk ends with it)."""
        return prefill_chunks(prompt_length, self.prefill_chunk)

    def prompt_chunks(self, prompt: list[int], start: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
        """The (ids [C], mask [C]) chunks of a prompt from token `start`. Without a prefix block size: left-padded
        as `Generator` pads a prompt (start 0 only). With one: full chunks from `start` (a multiple of it), so
        every chunk ends on a block boundary, the last chunk right-padded to a compiled length."""
        if self.prefix_block is None:
            if start:
                raise ValueError("resuming a prompt needs the prefix-cache layout (prefix_block)")
            chunks = self.chunks(len(prompt))
            padded = sum(chunks)
            ids, mask = np.zeros(padded, np.int32), np.zeros(padded, bool)
            ids[padded - len(prompt) :], mask[padded - len(prompt) :] = prompt, True
            bounds = np.cumsum([0, *chunks])
            return [(ids[a:b], mask[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        pieces = []
        for first in range(start, len(prompt), self.prefill_chunk):
            piece = prompt[first : first + self.prefill_chunk]
            length = next(c for c in self.chunk_lengths() if c >= len(piece))
            ids, mask = np.zeros(length, np.int32), np.zeros(length, bool)
            ids[: len(piece)], mask[: len(piece)] = piece, True
            pieces.append((ids, mask))
        return pieces

    def chunk_lengths(self) -> list[int]:
        """Every chunk length a prompt can use: the power-of-two heads and the full chunk."""
        lengths = {self.prefill_chunk}
        length = MIN_CHUNK
        while length < self.prefill_chunk:
            lengths.add(length)
            length *= 2
        return sorted(lengths)

    def prefill_rows(self, length: int) -> int:
        """How many prompts' chunks of `length` tokens one prefill step runs: the token budget's worth."""
        return max(1, min(self.max_batch, self.prefill_budget // length))

    def prefill(self, slots: list[int], chunks: list[tuple[np.ndarray, np.ndarray]], fresh: list[bool]) -> jax.Array:
        """Run one chunk [C] (ids, mask: false on pads) of each slot's prompt, all of one length, as one step of
        `prefill_rows(C)` rows (unused rows are padding; one chunk alone runs as one row); fresh: the slot's
        first chunk. -> hidden [P, D] at each row's last real token."""
        length = len(chunks[0][0])
        rows = 1 if len(slots) == 1 else self.prefill_rows(length)  # a lone prompt runs alone: no padding rows
        if len(slots) > rows or any(len(ids) != length for ids, _ in chunks):
            raise ValueError(f"a prefill step takes up to {rows} chunks of one length, got {len(slots)}")
        pad = rows - len(slots)
        ids_PC = np.stack([ids for ids, _ in chunks] + [np.zeros(length, np.int32)] * pad)
        mask_PC = np.stack([mask for _, mask in chunks] + [np.ones(length, bool)] * pad)
        self.cache, self.seen_BV, hidden_PD = _prefill(
            self.static,
            self.leaves,
            self._synced(),
            self.seen_BV,
            jnp.asarray(list(slots) + [self.max_batch] * pad, jnp.int32),
            jnp.asarray(ids_PC, jnp.int32),
            jnp.asarray(mask_PC, bool),
            jnp.asarray(list(fresh) + [True] * pad, bool),
            jnp.asarray([np.flatnonzero(mask)[-1] for mask in mask_PC], jnp.int32),
        )
        return hidden_PD

    def assign(self, slot: int, shared: list[int], tokens: int) -> None:
        """Give `slot` the pages of `tokens` slots: `shared` (a cached prefix's pages, in order) first, then pages
        of its own."""
        own = self.pages.allocate(self.pages.pages_for(tokens) - len(shared))
        self.pages.share(shared)
        self.page_table_BN[slot] = self.pages.num_pages
        self.page_table_BN[slot, : len(shared) + len(own)] = shared + own
        self._table_changed = True

    def block_pages(self, slot: int, start: int) -> tuple[int, ...]:
        """The pages of the slot's prefix block at token `start` (a multiple of the block)."""
        first, count = start // self.pages.page_size, self.prefix_block // self.pages.page_size
        return tuple(int(p) for p in self.page_table_BN[slot, first : first + count])

    def snapshot(self, slot: int) -> tuple:
        """The slot's KDA states now: with a block's pages, a prefix-cache node."""
        return _snapshot(self.cache, jnp.int32(slot))

    def restore(self, slot: int, kda: tuple, prefix: list[int]) -> None:
        """Resume `slot` after a cached `prefix` (its pages already the first of the slot's, `assign`): the KDA
        states `kda` of its end, its length, its tokens' seen marks."""
        ids_1L, mask_1L = np.zeros((1, self.max_context), np.int32), np.zeros((1, self.max_context), bool)
        ids_1L[0, : len(prefix)], mask_1L[0, : len(prefix)] = prefix, True
        self.cache, self.seen_BV = _restore(
            self._synced(), self.seen_BV, jnp.int32(slot), kda, jnp.asarray(ids_1L), jnp.asarray(mask_1L)
        )

    def _synced(self) -> LingCache:
        """The cache with the host's page table (sent to the device once after each change)."""
        if self._table_changed:
            table_BN = jnp.array(self.page_table_BN, copy=True)  # never a view of the host's table, edited in place
            self.cache = self._place(self.cache.replace(page_table=table_BN))
            self._table_changed = False
        return self.cache

    def first_token(self, slot: int, hidden_1D: jax.Array, params: SamplingParams) -> int:
        """Sample the request's first token and make `slot` ready to decode with `params`."""
        self._params[slot] = params
        self._arrays = None
        token, self.seen_BV, self.token_B, self.steps_B = _first_token(
            self.static,
            self.leaves,
            self.seen_BV,
            self.token_B,
            self.steps_B,
            jnp.int32(slot),
            hidden_1D,
            SamplingArrays.from_params([params]),
        )
        return int(token)

    def release(self, slot: int) -> None:
        """The slot's request is gone: its pages go back (those no one else holds are free) and it samples
        greedily (the cheap branch) until reused."""
        self.pages.release(int(p) for p in self.page_table_BN[slot] if p < self.pages.num_pages)
        self.page_table_BN[slot] = self.pages.num_pages
        self._table_changed = True
        if self._params[slot] is not GREEDY:
            self._params[slot] = GREEDY
            self._arrays = None

    def decode(self, active_B: np.ndarray) -> jax.Array:
        """Dispatch one decode step of every slot; -> the new token of each slot [B] (meaningful where active),
        on its way to the host (the step runs while the caller does other work)."""
        if self._arrays is None:
            self._arrays = SamplingArrays.from_params(self._params)
        tokens_B, self.cache, self.seen_BV, self.token_B, self.steps_B = _decode(
            self.static,
            self.leaves,
            self._synced(),
            self.seen_BV,
            self.token_B,
            self.steps_B,
            self._arrays,
            jnp.asarray(active_B, bool),
        )
        tokens_B.copy_to_host_async()
        return tokens_B

    def warm_up(self) -> None:
        """Compile every program (each prefill chunk length, the prefix cache's snapshot and restore, the first
        token, the decode step) on slot 0 (no pages: nothing is written)."""
        for length in self.chunk_lengths():
            chunk = (np.ones(length, np.int32), np.ones(length, bool))
            if self.prefill_rows(length) > 1:  # the step of several rows; then the lone one
                self.prefill([0, 1], [chunk, chunk], [True, True])
            hidden_1D = self.prefill([0], [chunk], [True])
        if self.prefix_block is not None:
            self.restore(0, self.snapshot(0), [1] * self.prefix_block)
        self.first_token(0, hidden_1D, GREEDY)
        self.decode(np.zeros(self.max_batch, bool))
        self.release(0)
        jax.block_until_ready(self.cache)
