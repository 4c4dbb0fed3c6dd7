"""The device side of the server: a batch of `max_batch` fixed slots and the jitted programs that run over it.

Each slot holds one request: its rows of a paged `LingCache` (KDA recurrent state and conv window, length, and
its page-table row: the pages of every MLA layer's latent cache that hold its tokens), its row of the repetition
penalty's seen-token mask, its generated tokens' counts (presence / frequency penalties), its last token and its
token count. The MLA pages come from one pool
(`PagePool`, reference counted on the host): a request is given pages for its prompt and completion when it is
admitted, the ones of a cached prefix shared with the prefix cache and the other requests reading them, and
frees them when it ends. The pool holds every slot's worth of pages plus the prefix cache's, so it never runs
out. The slot batch is a `DecodeState` (the `Generator`'s batch state: cache, seen rows, tokens, counts and, with
MTP, drafts), and a program's tokens are `NewTokens`, both named pytrees. Three programs, each compiled once per
shape and run with the slot batch donated (by name, `state`):

- `prefill`: one chunk of each of up to `prefill_rows(C)` requests' prompts (chunks of one length C, as many
  as `prefill_budget` tokens allow; a lone chunk runs as one row) into their slots (a first chunk resets
  its slot). A prompt is laid out as `Generator` lays out a prompt run alone (left-padded to a power-of-two
  head chunk, then full chunks of `prefill_chunk`), so each chunk length compiles once or twice (one row;
  the budget's rows) and each row computes what a batch-1 `Generator.generate` computes;
- `first_token`: the request's first token from its last prompt position (`generator.first_token` on its slot);
- `step`: one decode step of every slot (`generator.decode_step`), or with MTP a speculative round, or
  `decode_steps` of them in one program (the scheduler's choice when nothing else waits), a slot stopping on the
  device at its capacity or its end token (EOS, stop token ids: `first_token`'s end_ids, never fed back). Slots
  that are not decoding run too, with no pages (they read and write only a scratch page) and a pad token as input
  (`decode_step`'s real_B), which leaves their state (KDA states, length, seen and counted tokens) as it was:
  every slot's state is read and written in place, never copied or selected.

`warm_up` compiles them before the first request, the prefill and decode programs from their arguments' shapes
in worker threads (`ling_jax.serving.programs`); with `background`, the longer chunk lengths, the several-row
prefill steps, the smaller decode buckets and the programs of `decode_steps` steps compile on after it returns,
and `prefill`, `decode_rows` and `decode` run around them until they are done (a chunk in pieces of a compiled
length, rows one at a time, a larger bucket, one step). In a job of several processes (`--distributed`) it runs
each program once instead, through the calls process 0 publishes (`ling_jax.serving.replicated`). Over a mesh,
every program gives the slot batch back laid out as it took it (`_pinned`): a program's input in another layout
would be another program to compile; on one process, its small inputs built on the host are committed replicated
(`_replicated`), and the host's work on a several-row prefill step's hidden states is compiled by the warm-up too
(`_warm_up_rows`), so the first requests compile nothing.

A request that asks for its prompt's logprobs (OpenAI's `echo` with `logprobs`) gets them from `prompt_logprobs`:
a forward pass of its own over the prompt, in the prefill's chunks, on a one-row cache outside the slots (so the
prompt is run twice: once for these, once into its slot), each chunk's logits reduced on the device to the
log-softmax at the next prompt token and the top MAX_LOGPROBS (`sampling.logprobs_at`). It compiles at the first
such request, once per chunk length.

A request's other choices (OpenAI's `n`) are forks of its slot after its prompt's prefill (`fork`): each
sibling slot gets the prompt's whole pages shared (by reference count, never written: decoding writes past the
prompt) and a copy of its last, partial page, and a copy of every per-slot row (KDA states, length, seen
tokens, MTP state); then it draws its own first token from the same hidden state.

MTP speculation (`mtp` = K > 0, a model with an MTP layer): each slot also holds its MTP state (`SlotDrafts`):
the MTP layer's latent cache as a fixed buffer of `max_context` rows per slot (not paged: one layer, so
`max_batch` x `max_context` x 576 values; it is gathered per prefill row like the KDA states), the carry (the
main model's hidden at the last prefilled token, whose MTP entry needs the token after it), and the slot's next
draft with its MTP hidden. A prefill chunk also writes its MTP entries (`_prefill_drafts`), the first token
adds the last prompt position's and drafts (`first_draft`), and the step is a speculative round of every slot
(`speculative_rounds` of one round or `decode_steps`, the program `Generator` runs): K drafts chained through
the MTP layer, K + 1 positions verified in one main-model pass whose KDA layers keep every token's state, each
slot's targets drawn with its own sampler, a draft accepted while it equals its target, and each slot committed
at its own accepted boundary (KDA state and conv window of the last accepted token, length; MLA rows past it
lie beyond the length, MTP entries re-run on the accepted tokens). A slot emits targets[:accepted + 1]: exactly
the tokens plain decoding gives, greedy or sampled, and no more than its request's max_tokens (`Engine.assign`'s
capacity) or past its end token: the step already dispatched when a request ends leaves its slot as it is. A slot
that runs no round keeps its state in place, as in the plain step: its drafts and verified tokens are pads. A
prefix-cache snapshot then also holds the block's MTP entries and the carry, so a resumed request drafts as a cold
one does.

A VL model's request with images (`media_prefill`) gets its prompt's embeddings with the vision tower's output
merged in and its (t, h, w) mRoPE positions, cut into its chunks, which `prefill` runs one row at a time; its
slot then decodes at cache length + the slot's position offset (`position_offsets_B`, zero for text prompts).

Sampling is `ling_jax.generation.sampling.sample`: a row's key is fold_in(key(seed), token index), so a
request's tokens depend on its own seed and position only, never on the other slots. A request with a grammar
(structured outputs) gives `first_token` and each `decode` its bitmask of allowed tokens, the step's
`SamplingArrays.token_bitmask_BW` row (every other row allows every token).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Collection
from concurrent.futures import Future
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ling_jax.cache import KDAState, LingCache, MTPCache
from ling_jax.checkpoints.pieces import one_device_sharding
from ling_jax.config import MLA
from ling_jax.generation.end_tokens import end_bitmask, is_end
from ling_jax.generation.generator import (
    MIN_CHUNK,
    DecodeState,
    Drafts,
    MediaInputs,
    NewTokens,
    decode_step,
    first_token,
    media_prefill_inputs,
    prefill_chunks,
    speculative_rounds,
    where_rows,
)
from ling_jax.generation.grammar_mask import unconstrained
from ling_jax.generation.sampling import Logprobs, SamplingArrays, SamplingParams, logprobs_at, seen_from_prompts
from ling_jax.generation.sampling_features import PLAIN_GREEDY, SamplingFeatures
from ling_jax.generation.static_model import split_model
from ling_jax.model import LingForCausalLM
from ling_jax.serving.pages import PagePool
from ling_jax.serving.programs import ProgramCompiler, ProgramStore, StoredProgram, usable
from ling_jax.sharding import cache_shardings, shard_model

GREEDY = SamplingParams(temperature=0.0)  # what an idle slot "samples" with: the cheapest branch of `sample`
DECODE_STEPS = 4  # ling-serve's --decode-steps: decode steps per program when nothing else waits
# MLA cache slots per page: the Hopper paged decode kernel reads pages of a multiple of 64 in place, the TPU one
# pages of a multiple of 16 (bf16; 8 for fp32)
PAGE_SIZE = 64


def _slot_rows(tree, slot):
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0), tree)


def _put_slot_rows(tree, rows, slot):
    return jax.tree.map(lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r, slot, axis=0), tree, rows)


class Snapshot(NamedTuple):
    """A slot's state at a prefix block's end (`Engine.snapshot`)."""

    kda: tuple  # per KDA layer: the slot's KDAState ([1, ...] arrays)
    drafts: tuple | None  # with MTP: the block's MTP entries [1, block, A] and the carry [1, D]; else None


@struct.dataclass
class SlotDrafts(Drafts):
    """Each slot's MTP state (an `Engine` with `mtp` > 0): `Drafts` whose MTP cache is a fixed [B, max_context, A]
    buffer, one row per slot, and the carry."""

    carry_BD: jax.Array  # the main model's hidden at the slot's last prefilled token (its MTP entry needs the next)

    @classmethod
    def create(cls, config, batch_size: int, max_length: int, dtype) -> SlotDrafts:
        drafts = Drafts.create(config, batch_size, max_length, dtype)
        carry_BD = jnp.zeros((batch_size, config.hidden_size), dtype)
        return cls(drafts.cache, drafts.draft_B, drafts.draft_hidden_BD, carry_BD)


def _nbytes(tree) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def prefix_block_bytes(config, block: int, dtype, mtp: int) -> int:
    """Device bytes of one prefix-cache node of `block` tokens (`Engine.snapshot` and the block's pages): every KDA
    layer's state and conv window for one slot, the block's rows of every MLA layer's latent pages, and with MTP
    the block's MTP entries and the carried hidden state."""
    cache = jax.eval_shape(lambda: LingCache.create(config, 1, 1, dtype))
    kda = sum(_nbytes(s) for s in cache.layers if isinstance(s, KDAState))
    pages = sum(kind == MLA for kind in config.layer_types) * block * config.latent_dim * jnp.dtype(dtype).itemsize
    drafts = 0
    if mtp:
        entries = jax.eval_shape(lambda: MTPCache.create(config, 1, block, dtype)).layer
        drafts = _nbytes(entries) + config.hidden_size * jnp.dtype(dtype).itemsize
    return kda + pages + drafts


def _no_page(cache: LingCache) -> int:
    """The scratch page, the device pool's last (one past the `PagePool`'s, never given out): table entries of no
    page name it, so a slot without pages reads and writes only it (in bounds, for kernels reading in place)."""
    return next(s.latent_pages.shape[0] for s in cache.layers if not isinstance(s, KDAState)) - 1


def _select_rows(cache: LingCache, take, take_table) -> LingCache:
    """The rows `take` picks of the cache's per-slot arrays (`take_table` for the page table) over the whole
    pool."""
    layers = tuple(jax.tree.map(take, s) if isinstance(s, KDAState) else s for s in cache.layers)
    return LingCache(layers=layers, lengths=take(cache.lengths), page_table=take_table(cache.page_table))


def _put_rows(cache: LingCache, rows: LingCache, put) -> LingCache:
    """`cache` with the per-slot rows `put` writes from `rows`, and the pool `rows` holds."""
    layers = tuple(jax.tree.map(put, s, r) if isinstance(s, KDAState) else r for s, r in zip(cache.layers, rows.layers))
    return cache.replace(layers=layers, lengths=put(cache.lengths, rows.lengths))


def _gather_rows(cache: LingCache, slots_P) -> LingCache:
    """The slots' rows (slots past the batch: padding rows of zero states and no pages) over the whole pool."""
    return _select_rows(
        cache,
        lambda x: x.at[slots_P].get(mode="fill", fill_value=0),
        lambda table: table.at[slots_P].get(mode="fill", fill_value=_no_page(cache)),
    )


def _scatter_rows(cache: LingCache, rows: LingCache, slots_P) -> LingCache:
    """`cache` with the slots' rows and the pool `rows` holds (padding rows are dropped)."""
    return _put_rows(cache, rows, lambda x, r: x.at[slots_P].set(r, mode="drop"))


def _first(tree, rows: int):
    """Every leaf's first `rows` rows (slots [0, rows) of per-slot arrays)."""
    return jax.tree.map(lambda x: x[:rows], tree)


def _set_first(x, rows):
    """`x` with its first rows replaced by `rows`."""
    return x.at[: rows.shape[0]].set(rows)


def _put_first(tree, rows_tree):
    return jax.tree.map(_set_first, tree, rows_tree)


def _first_rows(cache: LingCache, rows: int) -> LingCache:
    """Slots [0, rows) of the cache over the whole pool."""
    return _select_rows(cache, lambda x: x[:rows], lambda table: table[:rows])


def _reset(rows: LingCache, fresh_P) -> LingCache:
    """Slot rows as a new request finds them where fresh_P: KDA states zero, length 0 (its pages' old contents
    lie past the length, invisible)."""
    layers = tuple(
        jax.tree.map(lambda x: where_rows(fresh_P, jnp.zeros_like(x), x), s) if isinstance(s, KDAState) else s
        for s in rows.layers
    )
    return rows.replace(layers=layers, lengths=jnp.where(fresh_P, 0, rows.lengths))


def _mark_seen(seen_BV, slots_P, ids_PC, mask_PC, fresh_P):
    """The slots' seen rows with their chunks' real tokens added (cleared first where fresh)."""
    kept_PV = seen_BV.at[slots_P].get(mode="fill", fill_value=False) & ~fresh_P[:, None]
    return seen_BV.at[slots_P].set(seen_from_prompts(ids_PC, mask_PC, seen_BV.shape[1]) | kept_PV, mode="drop")


def _prefill_drafts(model, drafts: SlotDrafts, hidden_PCD, slots_P, ids_PC, mask_PC, fresh_P, last_P) -> SlotDrafts:
    """A chunk's MTP entries: (hidden of the token before, token) for each real token but a prompt's first, the
    one before the chunk's first token being the slot's carry; the entry of the chunk's last token waits for the
    next chunk (or the first new token, `first_draft`) as the new carry. A prompt's entries are a batch-1
    `Generator`'s, in the same cache positions."""

    def take(x):
        return x.at[slots_P].get(mode="fill", fill_value=0)

    def put(x, r):
        return x.at[slots_P].set(r, mode="drop")

    rows = jax.tree.map(take, drafts.cache)
    rows = rows.replace(lengths=jnp.where(fresh_P, 0, rows.lengths))
    before_PCD = jnp.concatenate([take(drafts.carry_BD)[:, None].astype(hidden_PCD.dtype), hidden_PCD[:, :-1]], 1)
    after_real_PC = mask_PC & jnp.concatenate([~fresh_P[:, None], mask_PC[:, :-1]], axis=1)
    _, rows = model.draft_hidden(before_PCD, ids_PC, cache=rows, attention_mask=after_real_PC)
    last_PD = hidden_PCD[jnp.arange(ids_PC.shape[0]), last_P]
    return drafts.replace(cache=jax.tree.map(put, drafts.cache, rows), carry_BD=put(drafts.carry_BD, last_PD))


def _from_each_process(value, sharding: jax.sharding.NamedSharding) -> jax.Array:
    """A global array laid out by the replicated `sharding`, each process's devices given their copies of its own
    `value` (the same on every process)."""
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: np.asarray(host[index]))


def _state_shardings(state: DecodeState, mesh: jax.sharding.Mesh) -> DecodeState:
    """Where the slot batch lives over the mesh: the caches in their shardings (`cache_shardings`), the rest
    replicated (a pytree of `NamedSharding`s like `state`)."""
    replicated = jax.sharding.NamedSharding(mesh, jax.P())
    shardings = jax.tree.map(lambda _: replicated, state).replace(cache=cache_shardings(state.cache, mesh))
    if state.drafts is not None:
        shardings = shardings.replace(drafts=shardings.drafts.replace(cache=cache_shardings(state.drafts.cache, mesh)))
    return shardings


def _pinned(state: DecodeState, mesh: jax.sharding.Mesh | None) -> DecodeState:
    """A program's output state laid out over the mesh as its input was (`_state_shardings`, `Engine._place`),
    not as XLA would pick for it: the next program then takes the state as the warm-up compiled it, never in
    another layout (another program to compile). As it is without a mesh (one device)."""
    return state if mesh is None else jax.lax.with_sharding_constraint(state, _state_shardings(state, mesh))


@functools.partial(jax.jit, static_argnames=("static", "mesh"), donate_argnames="state")
def _prefill(
    static,
    leaves,
    state: DecodeState,
    slots_P,
    ids_PC,
    mask_PC,
    fresh_P,
    last_P,
    embeds_PCD=None,
    positions_PC3=None,
    mesh=None,
):
    """One prompt chunk per row [P, C] into slots_P (rows whose slot is past the batch are padding: computed,
    never written): their caches, seen rows and (with MTP) MTP entries; -> (hidden [P, D] at each row's column
    last_P, state). embeds_PCD / positions_PC3: a VL prompt's merged embeddings and (t, h, w) positions (None
    for text). mesh: the engine's (`_pinned`), as every program's here."""
    model = static.merge(leaves)
    rows = _reset(_gather_rows(state.cache, slots_P), fresh_P)
    hidden_PCD, rows = model.model(
        ids_PC,
        cache=rows,
        attention_mask=mask_PC,
        positions=positions_PC3,
        policy=model.policy,
        inputs_embeds=embeds_PCD,
    )
    drafts = state.drafts
    if drafts is not None:
        drafts = _prefill_drafts(model, drafts, hidden_PCD, slots_P, ids_PC, mask_PC, fresh_P, last_P)
    state = state.replace(
        cache=_scatter_rows(state.cache, rows, slots_P),
        seen_BV=_mark_seen(state.seen_BV, slots_P, ids_PC, mask_PC, fresh_P),
        drafts=drafts,
    )
    hidden_PD = hidden_PCD[jnp.arange(ids_PC.shape[0]), last_P]
    if mesh is not None:  # replicated, as the warm-up takes its rows apart and puts them together (`_warm_up_rows`)
        hidden_PD = jax.lax.with_sharding_constraint(hidden_PD, jax.sharding.NamedSharding(mesh, jax.P()))
    return hidden_PD, _pinned(state, mesh)


@functools.partial(jax.jit, static_argnames="static", donate_argnames="cache")
def _prompt_chunk_logprobs(static, leaves, cache: LingCache, ids_1C, mask_1C, next_ids_1C):
    """One chunk of a prompt through a one-row cache: -> (the logprobs of each position's next token [C], cache)."""
    out = static.merge(leaves)(ids_1C, cache=cache, attention_mask=mask_1C)
    return logprobs_at(out.logits[0], next_ids_1C[0], top_k=jax.lax.top_k), out.cache


@jax.jit
def _snapshot(cache: LingCache, slot):
    """The slot's KDA states now (per KDA layer, [1, ...] arrays): with its pages, a prefix-cache node."""
    return tuple(_slot_rows(s, slot) for s in cache.layers if isinstance(s, KDAState))


@functools.partial(jax.jit, static_argnames="mesh", donate_argnames="state")
def _restore(state: DecodeState, slot, kda, ids_1L, mask_1L, mesh=None):
    """Resume the slot after a cached prefix (ids_1L where mask_1L; its pages are in the slot's table row): the
    last block's KDA states, the length, the prefix's tokens marked seen."""
    cache, kda = state.cache, iter(kda)
    layers = tuple(_put_slot_rows(s, next(kda), slot) if isinstance(s, KDAState) else s for s in cache.layers)
    lengths = cache.lengths.at[slot].set(mask_1L.sum(dtype=jnp.int32))
    seen_BV = _mark_seen(state.seen_BV, slot[None], ids_1L, mask_1L, jnp.ones((1,), bool))
    return _pinned(state.replace(cache=cache.replace(layers=layers, lengths=lengths), seen_BV=seen_BV), mesh)


@functools.partial(jax.jit, static_argnames="block")
def _snapshot_drafts(drafts: SlotDrafts, slot, first, block: int):
    """The slot's MTP entries a prefix block wrote (rows [first, first + block) of its MTP cache, first = the
    block's start - 1, or 0 for a prompt's first block) and its carry: ([1, block, A], [1, D])."""
    latent_1SA = _slot_rows(drafts.cache.layer.latent, slot)
    return jax.lax.dynamic_slice_in_dim(latent_1SA, first, block, axis=1), _slot_rows(drafts.carry_BD, slot)


@functools.partial(jax.jit, static_argnames="mesh", donate_argnames="state")
def _restore_drafts(state: DecodeState, slot, first, rows_1KA, carry_1D, length, mesh=None):
    """Put a block's MTP entries (`_snapshot_drafts`) back at row `first` of the slot's MTP cache, its length and
    carry those at the block's end."""
    drafts = state.drafts
    latent = drafts.cache.layer.latent
    latent_1SA = jax.lax.dynamic_update_slice_in_dim(_slot_rows(latent, slot), rows_1KA, first, axis=1)
    mtp_cache = MTPCache(
        layer=drafts.cache.layer.replace(latent=_put_slot_rows(latent, latent_1SA, slot)),
        lengths=drafts.cache.lengths.at[slot].set(length),
    )
    drafts = drafts.replace(cache=mtp_cache, carry_BD=_put_slot_rows(drafts.carry_BD, carry_1D, slot))
    return _pinned(state.replace(drafts=drafts), mesh)


@functools.partial(jax.jit, static_argnames="mesh", donate_argnames="state")
def _fork(state: DecodeState, parent, child, from_page, to_page, mesh=None) -> DecodeState:
    """`child`'s per-slot rows a copy of `parent`'s (KDA states, length, seen tokens, counts, MTP state), and page
    `to_page` of every MLA layer a copy of page `from_page`."""

    def copy_row(x):
        return _put_slot_rows(x, _slot_rows(x, parent), child)

    cache = state.cache
    layers = tuple(
        jax.tree.map(copy_row, s)
        if isinstance(s, KDAState)
        else s.replace(latent_pages=s.latent_pages.at[to_page].set(s.latent_pages[from_page]))
        for s in cache.layers
    )
    rows = jax.tree.map(copy_row, state.replace(cache=None))
    return _pinned(rows.replace(cache=cache.replace(layers=layers, lengths=copy_row(cache.lengths))), mesh)


@functools.partial(jax.jit, static_argnames=("static", "mesh"), donate_argnames="state")
def _first_token(static, leaves, state: DecodeState, slot, hidden_1D, arrays_1: SamplingArrays, mesh=None):
    """The request's first token (`first_token` on the slot's row: its token index 0); the slot's token, count
    and seen row updated; with MTP, the last prompt position's MTP entry and the slot's first draft. ->
    (NewTokens [1, 1], state)."""
    slots = state.replace(cache=None)  # the cache is not per slot (its MLA pages are one pool) and unused here
    new, row = first_token(static.merge(leaves), _slot_rows(slots, slot), hidden_1D, arrays_1)
    return new, _pinned(_put_slot_rows(slots, row, slot).replace(cache=state.cache), mesh)


def _without_idle_pages(cache: LingCache, active_B) -> LingCache:
    """The cache as a step sees it: slots not active have no pages (they touch only the scratch page: a new
    request's slot may list shared pages before its first prefill)."""
    no_pages_BN = jnp.full_like(cache.page_table, _no_page(cache))
    return cache.replace(page_table=jnp.where(active_B[:, None], cache.page_table, no_pages_BN))


def _first_slots(state: DecodeState, rows: int) -> DecodeState:
    """Slots [0, rows) of the state (the MLA page pool whole)."""
    return _first(state.replace(cache=None), rows).replace(cache=_first_rows(state.cache, rows))


def _put_first_slots(state: DecodeState, first: DecodeState) -> DecodeState:
    """`state` with its first slots (and the MLA page pool) from `first` (`_first_slots`)."""
    put = _put_first(state.replace(cache=None), first.replace(cache=None))
    return put.replace(cache=_put_rows(state.cache, first.cache, _set_first))


def _decode_steps(
    model, num_steps: int, state: DecodeState, arrays: SamplingArrays, active_R, capacity_R, end_bits_RW, offsets_R
):
    """num_steps decode steps (a `lax.scan`, each token fed back on the device) of the active slots; a slot runs a
    step while below its capacity (its last token then fills its pages) and its last token is not one of its end
    tokens (end_bits_RW, `end_tokens`), else it stops where it is (the end token is never fed back). -> (NewTokens
    [R, num_steps]: slot r's are tokens_BT[r, :counts_B[r]]; state)."""

    def step(state, _):
        ended_R = is_end(end_bits_RW, state.token_B[:, None])[:, 0]
        running_R = active_R & (state.cache.lengths + 1 < capacity_R) & ~ended_R
        new, state = decode_step(model, state, arrays, offsets_R, running_R)
        return state, (*jax.tree.map(lambda x: x[:, 0], (new.tokens_BT, new.logprobs)), running_R)

    state, (tokens_GR, logprobs, ran_GR) = jax.lax.scan(step, state, length=num_steps)
    tokens_RG, logprobs = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), (tokens_GR, logprobs))
    return NewTokens(tokens_RG, ran_GR.sum(axis=0, dtype=jnp.int32), logprobs), state


@functools.partial(
    jax.jit, static_argnames=("static", "num_drafts", "rows", "num_steps", "mesh"), donate_argnames="state"
)
def _step(
    static,
    num_drafts,
    rows,
    num_steps,
    leaves,
    state: DecodeState,
    arrays: SamplingArrays,
    active_R,
    capacity_R,
    end_bits_BW,
    offsets_R=None,
    mesh=None,
):
    """num_steps decode steps (num_drafts = 0: `_decode_steps`) or speculative rounds (`speculative_rounds`, the
    program `Generator` runs) of slots [0, rows) (the engine's bucket over its active slots); slots not active have
    no pages in it and keep their state, in place. A slot stops at its capacity (capacity_R: the tokens its pages
    were assigned for, `Engine.assign`), so every token it keeps read its own pages only, never the scratch page,
    and at its end token (end_bits_BW: each slot's EOS and stop token ids, `end_tokens`; the scheduler still sees
    the end, the device only stops feeding the slot). offsets_R: a VL engine's per-slot mRoPE position offsets
    (None for a text model; a VL model has no MTP here). -> (NewTokens over the R slots, meaningful where active;
    state)."""
    model = static.merge(leaves)
    before = _first_slots(state, rows)
    stepping = before.replace(cache=_without_idle_pages(before.cache, active_R))
    arrays, end_bits_RW = _first(arrays, rows), end_bits_BW[:rows]
    if num_drafts:
        new, stepped = speculative_rounds(
            model, num_drafts, num_steps, stepping, arrays, active_R, capacity_R, end_bits_RW
        )
    else:
        new, stepped = _decode_steps(model, num_steps, stepping, arrays, active_R, capacity_R, end_bits_RW, offsets_R)
    return new, _pinned(_put_first_slots(state, stepped), mesh)


def decode_buckets(max_batch: int) -> list[int]:
    """The slot counts a decode step compiles for: powers of two below `max_batch`, and `max_batch`. A step runs
    the smallest that holds every active slot (slots are taken lowest first), so a lone request does not pay for
    a full batch."""
    return sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)})


def _warm_up_chunks(length: int, rows: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`rows` chunks of `length` real tokens (`Engine.warm_up`'s prefills)."""
    return [(np.ones(length, np.int32), np.ones(length, bool))] * rows


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
        mtp: int = 0,
        decode_steps: int = 1,
        plain_greedy_programs: bool | None = None,
    ):
        """prefix_cache_bytes: the prefix cache's size (0: none); the pool gets that many bytes of pages more, and
        prompts are chunked on prefix blocks (prefill chunks, whole pages). mtp: MTP drafts per decode step (0:
        plain decoding; needs a model with an MTP layer). decode_steps: the decode steps (with MTP, speculative
        rounds) of one program when the scheduler has nothing else to run (`decode`'s steps).
        plain_greedy_programs: `warm_up` also compiles each decode program traced for plain greedy sampling, which
        `decode` runs while every slot samples so (`_plain_program_ready`); None: on a GPU (where the general
        program's conditionals cost more than their predicates: `sampling_features`), one process only."""
        if mtp < 0:
            raise ValueError(f"--mtp must be >= 0, got {mtp}")
        if decode_steps < 1:
            raise ValueError(f"--decode-steps must be >= 1, got {decode_steps}")
        if mtp and not model.config.num_nextn_predict_layers:
            raise ValueError(f"--mtp {mtp} needs a model with an MTP layer (num_nextn_predict_layers = 0 here)")
        if max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
        if prefill_chunk < MIN_CHUNK:
            raise ValueError(f"--prefill-chunk must be >= {MIN_CHUNK}, got {prefill_chunk}")
        limit = model.config.max_position_embeddings
        if not 2 <= max_context <= limit:
            raise ValueError(f"--max-context must be in [2, {limit}] (the model's context), got {max_context}")
        self.config = model.config
        self.vl_config = getattr(model, "vl_config", None)
        self.dtype = model.dtype
        self.max_batch = max_batch
        self.max_context = max_context
        self.mtp = mtp
        self.decode_steps = decode_steps
        if plain_greedy_programs is None:
            plain_greedy_programs = jax.default_backend() == "gpu" and jax.process_count() == 1
        self.plain_greedy_programs = plain_greedy_programs
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
        self.state = self._place(
            DecodeState.create(
                LingCache.create_paged(
                    self.config, max_batch, num_pages + 1, page_size, self.pages_per_slot, model.dtype
                ),
                jnp.zeros((max_batch, self.config.vocab_size), bool),
                SlotDrafts.create(self.config, max_batch, max_context, model.dtype) if mtp else None,
            )
        )
        self._params = [GREEDY] * max_batch
        self._arrays: SamplingArrays | None = None  # the device copy of _params, rebuilt after a change
        self._plain: bool | None = None  # whether every slot samples plainly greedily (PLAIN_GREEDY), after a change
        # a VL model's decode positions: a token in cache slot s of slot b sits at s + offsets_B[b] (after images)
        self.position_offsets_B = None if self.vl_config is None else np.zeros(max_batch, np.int32)
        self.capacity_B = np.zeros(max_batch, np.int32)  # the tokens each slot's pages were assigned for
        # programs compiling in the background (`warm_up`): {("prefill", length, rows), ("step", rows, steps) or
        # ("plain", rows, steps) (`_plain_program_ready`): the compilation's future}
        self._background: dict[tuple, Future] = {}
        # every program `warm_up` compiled or loaded from its store, by the same keys: a loaded one is called itself
        self._programs: dict[tuple, Future] = {}
        # each slot's end tokens (`first_token`'s end_ids), where a multi-step program stops it; its device copy
        self.end_bits_BW = end_bitmask([()] * max_batch, self.config.vocab_size)
        self._end_bits: jax.Array | None = None

    def _place(self, state: DecodeState) -> DecodeState:
        """`state` committed where the programs keep it (one device; over the mesh, the caches in their shardings
        and the rest replicated): an uncommitted input would compile each program again once its outputs,
        committed, come back."""
        if self.mesh is None:
            return jax.device_put(state, one_device_sharding())
        return jax.device_put(state, _state_shardings(state, self.mesh))

    def _replicated(self, inputs):
        """A program's small inputs built on the host (a step's rows, the sampling arrays; numpy) as device arrays
        in one transfer, committed replicated over the mesh: an uncommitted input is moved at each call into the
        layout XLA gave the program's parameter (e.g. the rows over the expert axis), by a program of jax's own
        (`_multi_slice`) run at every call and compiled at the first, after `ready` where the warm-up compiled
        without calling. Uncommitted without a mesh. In a job of several processes every process passes the same
        values (the followers repeat process 0's calls): each builds its devices' copies from its own (no
        device_put, which would check them equal on every process, a collective)."""
        if self.mesh is None:
            return jax.device_put(inputs)
        replicated = jax.sharding.NamedSharding(self.mesh, jax.P())
        if jax.process_count() == 1:
            return jax.device_put(inputs, replicated)
        return jax.tree.map(functools.partial(_from_each_process, sharding=replicated), inputs)

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

    def prefill(
        self,
        slots: list[int],
        chunks: list[tuple[np.ndarray, np.ndarray]],
        fresh: list[bool],
        media: tuple[jax.Array, jax.Array] | None = None,
    ) -> jax.Array:
        """Run one chunk [C] (ids, mask: false on pads) of each slot's prompt, all of one length, as one step of
        `prefill_rows(C)` rows (unused rows are padding; one chunk alone runs as one row); fresh: the slot's
        first chunk; media: a lone VL chunk's embeddings and positions (`media_prefill`). -> hidden [P, D] at
        each row's last real token."""
        length = len(chunks[0][0])
        rows = 1 if len(slots) == 1 else self.prefill_rows(length)  # a lone prompt runs alone: no padding rows
        if len(slots) > rows or any(len(ids) != length for ids, _ in chunks) or (media is not None and len(slots) > 1):
            raise ValueError(
                f"a prefill step takes up to {rows} chunks of one length (with media, one), got {len(slots)}"
            )
        if rows > 1 and not usable(self._background.get(("prefill", length, rows))):
            # its program still compiles (`warm_up`): one row at a time, each computing the same
            hidden = [self.prefill([slot], [chunk], [first]) for slot, chunk, first in zip(slots, chunks, fresh)]
            return jnp.concatenate(hidden)
        if media is None and not usable(self._background.get(("prefill", length, 1))):
            return self._prefill_in_pieces(slots[0], chunks[0], fresh[0])
        args = self._prefill_args(slots, chunks, fresh, media, rows)
        hidden_PD, self.state = self._run(("prefill", length, rows), _prefill, args)
        return hidden_PD

    def _prefill_in_pieces(self, slot: int, chunk: tuple[np.ndarray, np.ndarray], fresh: bool) -> jax.Array:
        """One slot's chunk whose program still compiles (`warm_up`) as consecutive shorter chunks of the longest
        compiled length that divides it (the shortest length always does), those of padding alone skipped; each
        piece computes what the chunk computes there. -> hidden [1, D] at its last real token."""
        ids_C, mask_C = chunk
        length = len(ids_C)
        piece = max(
            c
            for c in self.chunk_lengths()
            if c < length and length % c == 0 and usable(self._background.get(("prefill", c, 1)))
        )
        hidden_1D = None
        for first in range(0, length, piece):
            part = slice(first, first + piece)
            if mask_C[part].any():
                hidden_1D = self.prefill([slot], [(ids_C[part], mask_C[part])], [fresh])
                fresh = False
        return hidden_1D

    def _prefill_args(self, slots, chunks, fresh, media, rows: int) -> tuple:
        """`_prefill`'s arguments for `prefill`: the chunks as `rows` rows."""
        length = len(chunks[0][0])
        pad = rows - len(slots)
        ids_PC = np.stack([ids for ids, _ in chunks] + [np.zeros(length, np.int32)] * pad)
        mask_PC = np.stack([mask for _, mask in chunks] + [np.ones(length, bool)] * pad)
        rows_P = self._replicated(
            (
                np.asarray(list(slots) + [self.max_batch] * pad, np.int32),
                ids_PC.astype(np.int32),
                mask_PC.astype(bool),
                np.asarray(list(fresh) + [True] * pad, bool),
                np.asarray([np.flatnonzero(mask)[-1] for mask in mask_PC], np.int32),
            )
        )
        return (
            self.static,
            self.leaves,
            self._synced(),
            *rows_P,
            *(media or (None, None)),
            self.mesh,
        )

    def media_prefill(
        self, slot: int, chunks: list[tuple[np.ndarray, np.ndarray]], media: MediaInputs
    ) -> list[tuple[jax.Array, jax.Array]]:
        """A VL prompt's images through the vision tower: per chunk of its `prompt_chunks`, the merged embeddings
        [1, C, D] and (t, h, w) positions [1, C, 3] that `prefill` takes with it; the slot decodes at the
        positions after them."""
        ids_1T = np.concatenate([ids for ids, _ in chunks])[None]
        mask_1T = np.concatenate([mask for _, mask in chunks])[None]
        embeds_1TD, positions_1T3, offsets_1 = media_prefill_inputs(
            self.static, self.leaves, self.vl_config, ids_1T, mask_1T, media
        )
        self.position_offsets_B[slot] = int(offsets_1[0])
        bounds = np.cumsum([0, *(len(ids) for ids, _ in chunks)])
        return [(embeds_1TD[:, a:b], positions_1T3[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]

    def assign(self, slot: int, shared: list[int], tokens: int) -> None:
        """Give `slot` the pages of `tokens` slots (its prompt and completion: it decodes no further), `shared` (a
        cached prefix's pages, in order) first, then pages of its own."""
        own = self.pages.allocate(self.pages.pages_for(tokens) - len(shared))
        self.pages.share(shared)
        self.page_table_BN[slot] = self.pages.num_pages
        self.page_table_BN[slot, : len(shared) + len(own)] = shared + own
        self.capacity_B[slot] = tokens
        self._table_changed = True

    def block_pages(self, slot: int, start: int) -> tuple[int, ...]:
        """The pages of the slot's prefix block at token `start` (a multiple of the block)."""
        first, count = start // self.pages.page_size, self.prefix_block // self.pages.page_size
        return tuple(int(p) for p in self.page_table_BN[slot, first : first + count])

    def snapshot(self, slot: int, start: int) -> Snapshot:
        """The slot's state at the end of its prefix block at token `start`: with the block's pages, a prefix-cache
        node."""
        kda = _snapshot(self.state.cache, jnp.int32(slot))
        if self.state.drafts is None:
            return Snapshot(kda, None)
        first = jnp.int32(max(start - 1, 0))
        return Snapshot(kda, _snapshot_drafts(self.state.drafts, jnp.int32(slot), first, self.prefix_block))

    def restore(self, slot: int, path: list[Snapshot], prefix: list[int]) -> None:
        """Resume `slot` after a cached `prefix` (its pages already the first of the slot's, `assign`) from the
        snapshots of its blocks, in order: the last one's KDA states, its length, its tokens' seen marks; with
        MTP, every block's MTP entries and the last one's carry."""
        ids_1L, mask_1L = np.zeros((1, self.max_context), np.int32), np.zeros((1, self.max_context), bool)
        ids_1L[0, : len(prefix)], mask_1L[0, : len(prefix)] = prefix, True
        ids_1L, mask_1L = jnp.asarray(ids_1L), jnp.asarray(mask_1L)
        self.state = _restore(self._synced(), jnp.int32(slot), path[-1].kda, ids_1L, mask_1L, mesh=self.mesh)
        if self.state.drafts is None:
            return
        for block, snapshot in enumerate(path):
            start = block * self.prefix_block
            rows_1KA, carry_1D = snapshot.drafts
            self.state = _restore_drafts(
                self.state,
                jnp.int32(slot),
                jnp.int32(max(start - 1, 0)),
                rows_1KA,
                carry_1D,
                jnp.int32(start + self.prefix_block - 1),
                mesh=self.mesh,
            )

    def fork(self, parent: int, child: int, prompt_length: int, tokens: int) -> None:
        """Make `child` (no pages yet) the copy of `parent` after its `prompt_length`-token prompt's prefill (before
        its first token), with pages for `tokens` slots: the prompt's whole pages shared, its partial last page
        copied into the first of the child's own."""
        page_size = self.pages.page_size
        whole = prompt_length // page_size
        self.assign(child, [int(p) for p in self.page_table_BN[parent, :whole]], tokens)
        from_page = to_page = self.pages.num_pages  # no partial page: the scratch page onto itself
        if prompt_length % page_size:
            from_page, to_page = self.page_table_BN[parent, whole], self.page_table_BN[child, whole]
        pages = jnp.int32(from_page), jnp.int32(to_page)
        self.state = _fork(self._synced(), jnp.int32(parent), jnp.int32(child), *pages, mesh=self.mesh)

    def _synced(self) -> DecodeState:
        """The state with the host's page table in its cache (put on the device once after each change, in the
        table's sharding). The rest stays as the last program gave it (`_pinned`): a device_put of it would find
        its shardings spelled otherwise than `_place`'s and copy it, in a job of several processes compiling a
        program for the copy."""
        if self._table_changed:
            cache = self.state.cache
            # a copy: never a view of the host's table, edited in place
            table_BN = jax.device_put(self.page_table_BN.copy(), cache.page_table.sharding)
            self.state = self.state.replace(cache=cache.replace(page_table=table_BN))
            self._table_changed = False
        return self.state

    def first_token(
        self,
        slot: int,
        hidden_1D: jax.Array,
        params: SamplingParams,
        bitmask_W: np.ndarray | None = None,
        end_ids: Collection[int] = (),
    ) -> NewTokens:
        """Sample the request's first token (tokens [1, 1]) and make `slot` ready to decode with `params`.
        bitmask_W: the tokens its grammar allows (`grammar_mask`), if it has one. end_ids: the tokens that end the
        request (EOS, stop token ids): `decode` stops the slot on the device after one."""
        self._params[slot] = params
        self._arrays = self._plain = None
        end_bits_W = end_bitmask([end_ids], self.config.vocab_size)[0]
        if not np.array_equal(end_bits_W, self.end_bits_BW[slot]):
            self.end_bits_BW[slot] = end_bits_W
            self._end_bits = None
        arrays = SamplingArrays.from_params([params], self.config.vocab_size, host=True)
        if bitmask_W is not None:
            arrays = arrays.replace(token_bitmask_BW=bitmask_W[None])
        slot_, arrays = jax.device_put((np.int32(slot), arrays))  # one transfer
        first, self.state = _first_token(self.static, self.leaves, self.state, slot_, hidden_1D, arrays, mesh=self.mesh)
        return first

    def prompt_logprobs(self, prompt: list[int]) -> Logprobs:
        """The logprobs of the prompt's tokens after its first (on the host, [L - 1] and [L - 1, K]): each token's
        given the ones before it, and the top MAX_LOGPROBS there. A forward pass of its own, the slots untouched."""
        cache = LingCache.create(self.config, 1, self.max_context + self.prefill_chunk, self.dtype)
        if self.mesh is None:
            cache = jax.device_put(cache, one_device_sharding())
        else:
            cache = jax.device_put(cache, cache_shardings(cache, self.mesh))
        chunks = self.prompt_chunks(prompt)
        ids = np.concatenate([ids for ids, _ in chunks])
        mask = np.concatenate([mask for _, mask in chunks])
        next_ids = np.append(ids[1:], 0).astype(np.int32)
        parts, first = [], 0
        for chunk_ids, chunk_mask in chunks:
            part = slice(first, first + len(chunk_ids))
            logprobs, cache = _prompt_chunk_logprobs(
                self.static, self.leaves, cache, chunk_ids[None], chunk_mask[None], next_ids[None, part]
            )
            parts.append(logprobs)
            first += len(chunk_ids)
        logprobs = jax.tree.map(lambda *x: np.concatenate(x), *jax.device_get(parts))
        return jax.tree.map(lambda x: x[np.flatnonzero(mask)[:-1]], logprobs)

    def release(self, slot: int) -> None:
        """The slot's request is gone: its pages go back (those no one else holds are free) and it samples
        greedily (the cheap branch) until reused."""
        self.pages.release(int(p) for p in self.page_table_BN[slot] if p < self.pages.num_pages)
        self.page_table_BN[slot] = self.pages.num_pages
        self._table_changed = True
        if self.position_offsets_B is not None:
            self.position_offsets_B[slot] = 0
        if self._params[slot] is not GREEDY:
            self._params[slot] = GREEDY
            self._arrays = self._plain = None

    def decode_rows(self, active_B: np.ndarray) -> int:
        """The decode bucket of a step over the `active_B` slots."""
        last = int(np.flatnonzero(active_B)[-1]) + 1 if np.any(active_B) else 1
        # a bucket whose program still compiles (`warm_up`) is run around: the next larger one computes the same
        return next(
            b for b in decode_buckets(self.max_batch) if b >= last and usable(self._background.get(("step", b, 1)))
        )

    def decode(
        self,
        active_B: np.ndarray,
        rows: int | None = None,
        bitmasks: dict[int, np.ndarray] | None = None,
        steps: int = 1,
    ) -> NewTokens:
        """Dispatch `steps` decode steps of the slots (with MTP, speculative rounds) in one program, each slot
        stopping at its capacity; -> its `NewTokens` over slots [0, R), R = `decode_rows`: slot b's new tokens are
        tokens_BT[b, :counts_B[b]], meaningful where active, on their way to the host (the program runs while the
        caller does other work). While the program of `steps` still compiles (`warm_up`), one step runs instead.
        rows: the bucket to run instead (process 0's choice, `replicated`). bitmasks: {slot: [W] int32} the tokens
        each grammar allows (`grammar_mask`; a plain decode step only, not MTP's: one step)."""
        if bitmasks and steps > 1:
            raise ValueError("a grammar's bitmask holds for one decode step")
        rows = rows or self.decode_rows(active_B)
        if not usable(self._background.get(("step", rows, steps))):
            steps = 1
        plain = not bitmasks and self._plain_program_ready(rows, steps)
        key = ("plain" if plain else "step", rows, steps)
        new, self.state = self._run(key, _step, self._step_args(active_B, rows, steps, bitmasks, plain))
        for part in jax.tree.leaves(new):
            part.copy_to_host_async()
        return new

    def _plain_program_ready(self, rows: int, steps: int) -> bool:
        """Whether `decode` runs the plain-greedy program of bucket `rows` and `steps` steps: every slot samples
        greedily with no control, logprobs or grammar (an idle slot does: GREEDY), and that program has compiled
        in the background (`warm_up`; one process only). It is the general program's tokens without its
        conditionals, which cost a GPU program more than their predicates (`sampling_features`)."""
        if self._plain is None:
            self._plain = SamplingFeatures.of(self._params) == PLAIN_GREEDY
        future = self._background.get(("plain", rows, steps))
        return self._plain and future is not None and usable(future)

    def _step_args(
        self, active_B: np.ndarray, rows: int, steps: int, bitmasks: dict | None = None, plain: bool = False
    ) -> tuple:
        """`_step`'s arguments for `decode`: `steps` steps of bucket `rows`; plain: for the program traced for
        plain greedy sampling (`_plain_program_ready`)."""
        if self._arrays is None:
            self._arrays = self._replicated(SamplingArrays.from_params(self._params, self.config.vocab_size, host=True))
        arrays = self._arrays.replace(features=PLAIN_GREEDY) if plain else self._arrays
        if bitmasks:
            bitmask_BW = unconstrained(self.max_batch, self.config.vocab_size)
            for slot, bitmask_W in bitmasks.items():
                bitmask_BW[slot] = bitmask_W
            arrays = arrays.replace(token_bitmask_BW=self._replicated(bitmask_BW))
        active_R, capacity_R, offsets_R = self._replicated(
            (
                np.array(active_B[:rows], bool),  # copies: never a view of the host's arrays, edited in place
                np.array(self.capacity_B[:rows], copy=True),
                None if self.position_offsets_B is None else np.array(self.position_offsets_B[:rows], copy=True),
            )
        )
        if self._end_bits is None:
            self._end_bits = self._replicated(np.array(self.end_bits_BW, copy=True))
        return (
            self.static,
            self.mtp,
            rows,
            steps,
            self.leaves,
            self._synced(),
            arrays,
            active_R,
            capacity_R,
            self._end_bits,
            offsets_R,
            self.mesh,
        )

    def _run(self, key: tuple, fn, args: tuple):
        """The jitted `fn` on `args`, or the program `warm_up` loaded for `key` from its store where it takes them
        (a jitted function does not know a loaded program: it would trace and lower again)."""
        future = self._programs.get(key)
        if future is not None and future.done() and future.exception() is None:
            program = future.result()
            if isinstance(program, StoredProgram) and program.accepts(args):
                return program(*args)
        return fn(*args)

    def compiling(self) -> bool:
        """Whether programs still compile in the background (`warm_up`)."""
        return self.background_programs() > 0

    def background_programs(self) -> int:
        """How many programs still compile in the background (`warm_up`)."""
        return sum(not future.done() for future in self._background.values())

    def warm_up(
        self,
        on_program: Callable[[int, int], None] = lambda done, total: None,
        *,
        background: bool = False,
        store: ProgramStore | None = None,
    ) -> None:
        """Compile every program: each prefill chunk length's step of one row and (where the budget holds several)
        of several, the prefix cache's snapshot and restore, a fork, the first token, the decode programs of each
        bucket (one step and `decode_steps`; last, with `plain_greedy_programs`, the same traced for plain greedy
        sampling). The prefill and decode programs compile from their arguments' shapes
        in worker threads, several at once (`ProgramCompiler`); the others by running on slot 0 (no pages: nothing
        is written) and, for the fork, slot 1 (whose rows a new request resets). on_program(done, total) after
        each (ling-serve's progress lines; from the workers too).

        background: return once the programs every request needs are compiled (one row's prefill step of the
        shortest chunk length and of any length it does not divide, the one-step program of the largest decode
        bucket), the others compiling on in the background: until one is done, `prefill` runs a chunk in pieces
        of the longest compiled length that divides it and its rows one at a time, `decode` the next larger
        compiled bucket, and one step where it was asked for `decode_steps`; each computes what the program it
        stands in for computes.

        store: where the prefill and decode programs are kept as serialised executables (`ProgramStore`): one
        stored by an earlier start is loaded instead of compiled, and then called without tracing.

        In a job of several processes (`--distributed`) a program compiles at its first call, which every process
        makes in step, so each one is run instead (`_run_each_program`), through the engine's own calls (process
        0's are published to the others, `replicated`); background and store do not apply."""
        lengths, buckets = self.chunk_lengths(), decode_buckets(self.max_batch)
        idle_B = np.zeros(self.max_batch, bool)
        one_row = [("prefill", length, 1) for length in lengths]
        # the shortest chunk first (the runs below wait for it), then any length it does not divide; the others
        # are prefilled in pieces of a shorter length until their own program is compiled (`prefill`)
        first = [key for key in one_row if key[1] == lengths[0] or key[1] % lengths[0]] + [("step", buckets[-1], 1)]
        later = [key for key in one_row if key not in first]
        later += [
            ("step", rows, steps)
            for rows in reversed(buckets)
            for steps in sorted({1, self.decode_steps})
            if (rows, steps) != (buckets[-1], 1)
        ]
        later += [("prefill", length, self.prefill_rows(length)) for length in lengths if self.prefill_rows(length) > 1]
        if self.plain_greedy_programs and jax.process_count() == 1:  # last, taken over when done (`decode`)
            later += [("plain", rows, steps) for rows in reversed(buckets) for steps in sorted({1, self.decode_steps})]
        total = len(first) + len(later) + 1 + 2 * (self.prefix_block is not None) + (self.max_batch > 1)
        done, lock = iter(range(1, total + 1)), threading.Lock()

        def compiled() -> None:
            with lock:
                on_program(next(done), total)

        if jax.process_count() > 1:
            self._run_each_program(first + later, compiled)
            return

        def program(key: tuple) -> tuple:
            """The key's jitted function and its arguments (idle rows: only their shapes matter here)."""
            kind, size, count = key
            if kind == "prefill":
                return _prefill, self._prefill_args(
                    list(range(count)), _warm_up_chunks(size, count), [True] * count, None, count
                )
            return _step, self._step_args(idle_B, size, count, plain=kind == "plain")

        programs = {key: program(key) for key in first + later}
        compiler = ProgramCompiler(compiled, store=store)
        futures = {key: compiler.submit(*programs[key]) for key in first}
        self._programs = dict(futures)
        futures[("prefill", lengths[0], 1)].result()
        self._run_on_slot_0(compiled)
        self._warm_up_rows()
        for future in futures.values():
            future.result()
        # the others only now: compiling alongside, they would take the CPU from the programs above
        self._background = {key: compiler.submit(*programs[key]) for key in later}
        self._programs |= self._background
        compiler.close()
        if not background:
            for future in self._background.values():
                future.result()

    def _run_on_slot_0(self, compiled: Callable[[], None]) -> None:
        """`warm_up`'s programs run on slot 0 (no pages: nothing is written) after a prefill of the shortest chunk:
        the prefix cache's snapshot and restore, a fork into slot 1 (whose rows a new request resets) and the first
        token; compiled() after each."""
        hidden_1D = self.prefill([0], _warm_up_chunks(self.chunk_lengths()[0], 1), [True])
        if self.prefix_block is not None:
            snapshot = self.snapshot(0, 0)
            compiled()
            self.restore(0, [snapshot], [1] * self.prefix_block)
            compiled()
        if self.max_batch > 1:
            self.fork(0, 1, 1, 1)
            self.release(1)
            compiled()
        self.first_token(0, hidden_1D, GREEDY)
        compiled()
        self.release(0)
        jax.block_until_ready(self.state)

    def _warm_up_rows(self) -> None:
        """What the host does with a several-row prefill step's hidden states [P, D] compiled before `ready` (on
        one process, where the warm-up never runs that step): the one-row slice a first token takes (the
        scheduler's), and the rows of one-row steps put together (`prefill`, while the step's program compiles in
        the background). On a stand-in laid out as `_prefill` gives them (replicated over the mesh)."""
        where = one_device_sharding() if self.mesh is None else jax.sharding.NamedSharding(self.mesh, jax.P())
        row_1D = jnp.zeros((1, self.config.hidden_size), self.dtype, device=where)
        for rows in {self.prefill_rows(length) for length in self.chunk_lengths()} - {1}:
            jnp.concatenate([row_1D] * rows)[rows - 1 : rows].block_until_ready()

    def _run_each_program(self, keys: list[tuple], compiled: Callable[[], None]) -> None:
        """`warm_up` in a job of several processes: each program (`keys`, as `warm_up` names them) run once through
        the engine's calls, every process making the same ones in the same order, so `ready` means that every
        program a request can use exists. A prefill step runs its rows' chunks into slots [0, rows), whose rows a
        new request resets, and its last row's first token (the scheduler's slice of its hidden states); a decode
        step runs with every slot idle (their states kept). compiled() after each."""
        for kind, size, count in keys:
            if kind == "prefill":
                hidden_PD = self.prefill(list(range(count)), _warm_up_chunks(size, count), [True] * count)
                self.first_token(0, hidden_PD[count - 1 : count], GREEDY)
                compiled()
        self._run_on_slot_0(compiled)
        idle_B = np.zeros(self.max_batch, bool)
        for kind, size, count in keys:
            if kind == "step":
                self.decode(idle_B, rows=size, steps=count)
                compiled()
        jax.block_until_ready(self.state)
