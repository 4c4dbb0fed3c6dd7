"""The device side of the server: a batch of `max_batch` fixed slots and the jitted programs that run over it.

Each slot holds one request: its rows of a `LingCache` of `max_context` tokens (KDA recurrent state and conv
window, MLA latent rows, length), its row of the repetition penalty's seen-token mask, its last token and its
token count. Three programs, each compiled once per shape and run with the slot batch donated:

- `prefill`: one chunk of each of up to `prefill_rows(C)` requests' prompts (chunks of one length C, as many
  as `prefill_budget` tokens allow; a lone chunk runs as one row) into their slots (a first chunk resets
  its slot). A prompt is laid out as `Generator` lays out a prompt run alone (left-padded to a power-of-two
  head chunk, then full chunks of `prefill_chunk`), so each chunk length compiles once or twice (one row;
  the budget's rows) and each row computes what a batch-1 `Generator.generate` computes;
- `first_token`: the request's first token from its last prompt position;
- `decode`: one decode step of every slot. Slots that are not decoding (free, or between prefill chunks) run
  too, but keep their whole cache (the step's KDA state and length are dropped; its MLA row is written past
  the length, where the next chunk writes), token and token count.

Sampling is `ling_jax.generation.sampling.sample`: a row's key is fold_in(key(seed), token index), so a
request's tokens depend on its own seed and position only, never on the other slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.cache import KDAState, LingCache, MLAState
from ling_jax.generation.generator import MIN_CHUNK, prefill_chunks
from ling_jax.generation.sampling import SamplingArrays, SamplingParams, sample, seen_from_prompts, update_seen
from ling_jax.generation.static_model import split_model
from ling_jax.model import LingForCausalLM
from ling_jax.sharding import cache_shardings, shard_model

GREEDY = SamplingParams(temperature=0.0)  # what an idle slot "samples" with: the cheapest branch of `sample`


def _slot_rows(tree, slot):
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0), tree)


def _put_slot_rows(tree, rows, slot):
    return jax.tree.map(lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r, slot, axis=0), tree, rows)


def _reset(rows: LingCache, fresh_P) -> LingCache:
    """Slot rows as a new request finds them where fresh_P: KDA states zero, length 0 (MLA rows past the length
    are invisible, so they are left as they are)."""
    layers = tuple(
        jax.tree.map(lambda x: _where_rows(fresh_P, jnp.zeros_like(x), x), s) if isinstance(s, KDAState) else s
        for s in rows.layers
    )
    return LingCache(layers=layers, lengths=jnp.where(fresh_P, 0, rows.lengths))


def _mark_seen(seen_BV, slots_P, ids_PC, mask_PC, fresh_P):
    """The slots' seen rows with their chunks' real tokens added (cleared first where fresh)."""
    kept_PV = seen_BV.at[slots_P].get(mode="fill", fill_value=False) & ~fresh_P[:, None]
    return seen_BV.at[slots_P].set(seen_from_prompts(ids_PC, mask_PC, seen_BV.shape[1]) | kept_PV, mode="drop")


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(2, 3))
def _prefill(static, leaves, cache: LingCache, seen_BV, slots_P, ids_PC, mask_PC, fresh_P, last_P):
    """One prompt chunk per row [P, C] into slots_P (rows whose slot is past the batch are padding: computed,
    never written); -> (cache, seen, hidden [P, D] at each row's column last_P)."""
    model = static.merge(leaves)
    rows = jax.tree.map(lambda x: x.at[slots_P].get(mode="fill", fill_value=0), cache)
    hidden_PCD, rows = model.model(ids_PC, cache=_reset(rows, fresh_P), attention_mask=mask_PC, policy=model.policy)
    cache = jax.tree.map(lambda x, r: x.at[slots_P].set(r, mode="drop"), cache, rows)
    seen_BV = _mark_seen(seen_BV, slots_P, ids_PC, mask_PC, fresh_P)
    return cache, seen_BV, hidden_PCD[jnp.arange(ids_PC.shape[0]), last_P]


@functools.partial(jax.jit, static_argnums=3)
def _snapshot(cache: LingCache, slot, start, block: int):
    """The slot's KDA states (now) and MLA rows [start, start + block): a prefix-cache node's contents."""
    kda = tuple(_slot_rows(s, slot) for s in cache.layers if isinstance(s, KDAState))
    pages = tuple(
        jax.lax.dynamic_slice(s.latent, (slot, start, 0), (1, block, s.latent.shape[2]))
        for s in cache.layers
        if not isinstance(s, KDAState)
    )
    return kda, pages


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _restore_block(cache: LingCache, seen_BV, slot, start, pages, ids_1C, fresh):
    """Copy one cached block's MLA rows into the slot at `start` and mark its tokens seen."""
    pages = iter(pages)
    layers = tuple(
        s
        if isinstance(s, KDAState)
        else MLAState(latent=jax.lax.dynamic_update_slice(s.latent, next(pages), (slot, start, 0)))
        for s in cache.layers
    )
    seen_BV = _mark_seen(seen_BV, slot[None], ids_1C, jnp.ones(ids_1C.shape, bool), fresh[None])
    return LingCache(layers=layers, lengths=cache.lengths), seen_BV


@functools.partial(jax.jit, donate_argnums=0)
def _restore_state(cache: LingCache, slot, kda, length):
    """Set the slot's KDA states to a cached node's and its length to the cached tokens."""
    kda = iter(kda)
    layers = tuple(_put_slot_rows(s, next(kda), slot) if isinstance(s, KDAState) else s for s in cache.layers)
    lengths = cache.lengths.at[slot].set(length)
    return LingCache(layers=layers, lengths=lengths)


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
    """One decode step of every slot; slots not active keep their length, token and count."""
    out = static.merge(leaves)(token_B[:, None], cache=cache)
    next_B = jnp.where(active_B, sample(out.logits[:, 0], arrays, steps_B, seen_BV), token_B)
    layers = tuple(
        jax.tree.map(lambda new, old: _where_rows(active_B, new, old), s, before) if isinstance(s, KDAState) else s
        for s, before in zip(out.cache.layers, cache.layers)
    )
    cache = LingCache(layers=layers, lengths=jnp.where(active_B, out.cache.lengths, cache.lengths))
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
        prefix_block: int | None = None,
        prefill_budget: int | None = None,
    ):
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
        if prefix_block not in (None, prefill_chunk):
            raise ValueError(f"prefix blocks are prefill chunks ({prefill_chunk} tokens), got {prefix_block}")
        self.prefix_block = prefix_block  # set: prompts are chunked on block boundaries, for the prefix cache
        self.mesh = mesh
        if mesh is not None:
            shard_model(model, mesh)
        self.static, self.leaves = split_model(model)
        self.cache = self._place(LingCache.create(self.config, max_batch, max_context, model.dtype))
        self.seen_BV = jnp.zeros((max_batch, self.config.vocab_size), bool)
        self.token_B = jnp.zeros((max_batch,), jnp.int32)
        self.steps_B = jnp.zeros((max_batch,), jnp.int32)
        self._params = [GREEDY] * max_batch
        self._arrays: SamplingArrays | None = None  # the device copy of _params, rebuilt after a change

    def _place(self, cache: LingCache) -> LingCache:
        return cache if self.mesh is None else jax.device_put(cache, cache_shardings(cache, self.mesh))

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
            self.cache,
            self.seen_BV,
            jnp.asarray(list(slots) + [self.max_batch] * pad, jnp.int32),
            jnp.asarray(ids_PC, jnp.int32),
            jnp.asarray(mask_PC, bool),
            jnp.asarray(list(fresh) + [True] * pad, bool),
            jnp.asarray([np.flatnonzero(mask)[-1] for mask in mask_PC], jnp.int32),
        )
        return hidden_PD

    def snapshot(self, slot: int, start: int) -> tuple[tuple, tuple]:
        """The slot's KDA states now and its MLA rows of the block at `start`: a prefix-cache node."""
        return _snapshot(self.cache, jnp.int32(slot), jnp.int32(start), self.prefix_block)

    def restore(self, slot: int, blocks: list[tuple[list[int], tuple, tuple]]) -> None:
        """Resume `slot` after cached blocks [(tokens, kda, pages)] (the prompt's first blocks, in order): their
        MLA rows and tokens' seen marks, the last one's KDA states, the length."""
        for i, (tokens, _, pages) in enumerate(blocks):
            self.cache, self.seen_BV = _restore_block(
                self.cache,
                self.seen_BV,
                jnp.int32(slot),
                jnp.int32(i * self.prefix_block),
                pages,
                jnp.asarray([tokens], jnp.int32),
                jnp.bool_(i == 0),
            )
        self.cache = _restore_state(
            self.cache, jnp.int32(slot), blocks[-1][1], jnp.int32(len(blocks) * self.prefix_block)
        )

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
        """The slot's request is gone: it samples greedily (the cheap branch) until reused."""
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
            self.cache,
            self.seen_BV,
            self.token_B,
            self.steps_B,
            self._arrays,
            jnp.asarray(active_B, bool),
        )
        tokens_B.copy_to_host_async()
        return tokens_B

    def warm_up(self) -> None:
        """Compile every program (each prefill chunk length, the prefix cache's snapshot and restores, the first
        token, the decode step) on slot 0."""
        for length in self.chunk_lengths():
            chunk = (np.ones(length, np.int32), np.ones(length, bool))
            if self.prefill_rows(length) > 1:  # the step of several rows; then the lone one
                self.prefill([0, 1], [chunk, chunk], [True, True])
            hidden_1D = self.prefill([0], [chunk], [True])
        if self.prefix_block is not None:
            kda, pages = self.snapshot(0, 0)
            self.restore(0, [([1] * self.prefix_block, kda, pages)])
        self.first_token(0, hidden_1D, GREEDY)
        self.decode(np.zeros(self.max_batch, bool))
        self.release(0)
        jax.block_until_ready(self.cache)
