"""Batched generation: chunked prefill, then fixed-shape jitted decode programs of DECODE_READ_GROUP steps (or MTP
speculative rounds) each over donated caches, with per-request sampling and streaming callbacks.

Prompts are left-padded so that every row's last prompt token sits in the last column; the attention mask
keeps pads out of every KDA state and MLA cache. The padded prompt is cut into chunks of `prefill_chunk`
tokens (the first one shorter, a power of two), so activation memory is bounded by the chunk, and each
chunk size compiles once. Every decode program has fixed shapes: one compile per batch size and cache length
(rounded up to a multiple of 256), the last program of a generation included (it runs whole; the host drops
the tokens past max_new_tokens). Compiled programs persist across runs with JAX's compilation cache
(`JAX_COMPILATION_CACHE_DIR`).

Speculative decoding (`mtp=K`): the MTP layer drafts K tokens greedily; the main model verifies
[pending token ; K drafts] in one forward whose KDA layers keep the state after every token; each
position's target token is drawn with the request's own sampler and key, a draft is accepted while it equals
the target, and the caches are committed at the last accepted token (KDA: the kept per-token state; MLA:
the cache length; the MTP cache is rolled back and re-run on the accepted tokens). Every emitted token is
the target model's own draw, so the output is exactly the non-speculative output, with greedy or sampling.
A program runs DECODE_READ_GROUP rounds with no host in between: each round's accepted tokens go to the row's
next columns of a [B, DECODE_READ_GROUP * (K + 1)] buffer, a row stops (emits nothing more, keeps its state) at
an EOS or its length limit, and the host reads the buffer and the per-row counts once per program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ling_jax.cache import LingCache, MTPCache, commit_verified
from ling_jax.generation.compile_watch import CompileClock
from ling_jax.generation.end_tokens import end_bitmask, is_end
from ling_jax.generation.logit_controls import count_tokens
from ling_jax.generation.sampling import (
    Logprobs,
    SamplingArrays,
    SamplingParams,
    sample,
    seen_from_prompts,
    token_logprobs,
    update_seen,
)
from ling_jax.generation.static_model import split_model
from ling_jax.kda import STEPS
from ling_jax.model import LingForCausalLM
from ling_jax.mrope import MediaGrid, batch_mrope_positions
from ling_jax.sharding import cache_shardings, shard_model

MIN_CHUNK = 16
# generate.py's default prompt tokens a prefill call, over all rows (`default_prefill_chunk`): a 32k prompt on
# Ling-3.0-flash's first 20 layers (H100) prefilled at 72,328 tok/s in 8192-token calls against 44,238 in 2048
PREFILL_TOKENS = 8192
LEAST_DEFAULT_CHUNK = 2048  # the fixed default before PREFILL_TOKENS: no batch prefills fewer tokens a call
DECODE_READ_GROUP = 8  # decode steps (MTP rounds) per program and host read; the next one runs meanwhile
CACHE_BUCKET = 256  # cache lengths are rounded up to this, so nearby prompt lengths share compiled steps


@dataclasses.dataclass
class GenerationStats:
    """Timings of one `Generator.generate` call. The rates count steady-state work only: the prefill less the
    compilation inside it, and the decode programs (MTP rounds) after the first one, which compiles on a first
    call. A rate with nothing to measure (too few tokens per prompt to run a second program) is None."""

    prompt_tokens: int
    generated_tokens: int
    prefill_s: float  # prompt processing up to the first token, compilation included
    decode_s: float  # after the first token, compilation included
    ttft_s: float
    drafted: int = 0  # MTP draft tokens proposed / accepted
    accepted: int = 0
    compile_s: float = 0.0  # tracing and compiling (or loading from the compilation cache) in this call
    prefill_compile_s: float = 0.0  # the part of compile_s before the first token
    steady_steps: int = 0  # decode steps the device ran (whole programs) after the first program; MTP: rounds
    steady_tokens: int = 0  # the tokens they emitted (none past max_new_tokens or a row's end)
    steady_s: float = 0.0  # their time: first program's tokens on the host to the last's, less compiling between

    @property
    def prefill_tokens_per_s(self) -> float | None:
        run_s = self.prefill_s - self.prefill_compile_s
        return self.prompt_tokens / run_s if run_s > 0 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.steady_tokens / self.steady_s if self.steady_tokens and self.steady_s > 0 else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def summary(self) -> str:
        line = (
            f"prompt tokens {self.prompt_tokens}, generated {self.generated_tokens}; "
            f"prefill {_rate(self.prefill_tokens_per_s)}, decode {_rate(self.decode_tokens_per_s)} "
            f"(steady state); compile {self.compile_s:.1f} s; time to first token {self.ttft_s * 1e3:.0f} ms"
        )
        if self.drafted:
            line += f"; MTP acceptance {self.acceptance_rate:.1%} ({self.accepted}/{self.drafted})"
        return line


def _rate(tokens_per_s: float | None) -> str:
    return "n/a" if tokens_per_s is None else f"{tokens_per_s:.1f} tok/s"


@struct.dataclass
class Drafts:
    """Each row's MTP state (speculative decoding): the MTP layer's cache and the next round's first draft."""

    cache: MTPCache
    draft_B: jax.Array  # [B] int32: the first draft of the row's next round
    draft_hidden_BD: jax.Array  # the MTP hidden at that draft, which the round's next drafts chain from

    @classmethod
    def create(cls, config, batch_size: int, max_length: int, dtype) -> Drafts:
        return cls(
            cache=MTPCache.create(config, batch_size, max_length, dtype),
            draft_B=jnp.zeros((batch_size,), jnp.int32),
            draft_hidden_BD=jnp.zeros((batch_size, config.hidden_size), dtype),
        )


@struct.dataclass
class DecodeState:
    """What each program hands the next one, on the device: a row's cache, sampler history and next input. A
    `Generator`'s batch and a server's slot batch (`ling_jax.serving.engine`) alike; the programs donate it."""

    cache: LingCache
    seen_BV: jax.Array  # [B, V] bool: tokens the repetition penalty applies to
    counts_BV: jax.Array  # [B, V] int32: how often each row generated each token (presence / frequency penalties)
    token_B: jax.Array  # [B] int32: the last sampled token, the next step's input
    steps_B: jax.Array  # [B] int32: tokens each row has generated so far, its sampler's step
    drafts: Drafts | None = None  # with MTP speculation

    @classmethod
    def create(cls, cache: LingCache, seen_BV: jax.Array, drafts: Drafts | None = None) -> DecodeState:
        """The state before the first token: the prompts' caches and seen tokens; no token generated yet."""
        batch_size = cache.lengths.shape[0]
        counts_BV = jnp.zeros(seen_BV.shape, jnp.int32)
        return cls(
            cache, seen_BV, counts_BV, jnp.zeros((batch_size,), jnp.int32), jnp.zeros((batch_size,), jnp.int32), drafts
        )


@struct.dataclass
class NewTokens:
    """What a program gives each row: its new tokens are tokens_BT[b, :counts_B[b]] (one per decode step, none to
    K + 1 per speculative round), with their logprobs (`sampling.token_logprobs`: [B, T] and [B, T, K])."""

    tokens_BT: jax.Array  # [B, T] int32
    counts_B: jax.Array  # [B] int32
    logprobs: Logprobs
    rounds_B: jax.Array | None = None  # [B] int32, speculation: the rounds each row ran (K drafts each)


def _draw(logits_BV, arrays: SamplingArrays, steps_B, seen_BV, counts_BV) -> tuple[jax.Array, Logprobs]:
    """Each row's token [B] and its logprobs from the raw logits [B, V]."""
    token_B = sample(logits_BV, arrays, steps_B, seen_BV, counts_BV)
    return token_B, token_logprobs(logits_BV, token_B, arrays)


def _one_token(token_B, logprobs: Logprobs) -> NewTokens:
    """One new token per row: a token column [B, 1] and its logprobs."""
    return NewTokens(token_B[:, None], jnp.ones_like(token_B), jax.tree.map(lambda x: x[:, None], logprobs))


@functools.partial(jax.jit, static_argnames="static", donate_argnames="state")
def _prefill_chunk(
    static, leaves, state: DecodeState, ids_BC, mask_BC, next_ids_BC, mtp_mask_BC, embeds_BCD=None, positions_BC3=None
):
    """One prompt chunk into the state's caches; -> (hidden [B, D] at the chunk's last column, state).
    embeds_BCD / positions_BC3: a VL prompt's merged embeddings and (t, h, w) positions (None for text)."""
    model = static.merge(leaves)
    hidden_BCD, cache = model.model(
        ids_BC,
        cache=state.cache,
        attention_mask=mask_BC,
        positions=positions_BC3,
        policy=model.policy,
        inputs_embeds=embeds_BCD,
    )
    drafts = state.drafts
    if drafts is not None:
        _, mtp_cache = model.draft_hidden(hidden_BCD, next_ids_BC, cache=drafts.cache, attention_mask=mtp_mask_BC)
        drafts = drafts.replace(cache=mtp_cache)
    return hidden_BCD[:, -1], state.replace(cache=cache, drafts=drafts)


def first_draft(model: LingForCausalLM, drafts: Drafts, hidden_BD, token_B) -> Drafts:
    """The MTP entry of the last prompt position (its hidden, the first new token) and the first draft."""
    out = model.draft_logits(hidden_BD[:, None], token_B[:, None], cache=drafts.cache)
    draft_B = jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)
    return drafts.replace(cache=out.cache, draft_B=draft_B, draft_hidden_BD=out.hidden[:, 0])


def first_token(
    model: LingForCausalLM, state: DecodeState, hidden_BD, arrays: SamplingArrays
) -> tuple[NewTokens, DecodeState]:
    """Each row's first new token (its token index 0) from its last prompt position; with MTP, also that
    position's MTP entry and the first draft (traced inside a jitted program)."""
    counts_BV = jnp.zeros_like(state.counts_BV)  # a row's first token: none generated before it
    token_B, logprobs = _draw(
        model.logits(hidden_BD[:, None])[:, 0], arrays, jnp.zeros_like(state.steps_B), state.seen_BV, counts_BV
    )
    drafts = None if state.drafts is None else first_draft(model, state.drafts, hidden_BD, token_B)
    state = state.replace(
        seen_BV=update_seen(state.seen_BV, token_B),
        counts_BV=count_tokens(counts_BV, token_B),
        token_B=token_B,
        steps_B=jnp.ones_like(state.steps_B),
        drafts=drafts,
    )
    return _one_token(token_B, logprobs), state


@functools.partial(jax.jit, static_argnames="static", donate_argnames="state")
def _first_token(static, leaves, state: DecodeState, hidden_BD, arrays) -> tuple[NewTokens, DecodeState]:
    return first_token(static.merge(leaves), state, hidden_BD, arrays)


@functools.partial(jax.jit, static_argnums=(0, 4, 6))
def _media_embeddings(static, leaves, ids_BT, pixel_values, image_grids, pixel_values_videos, video_grids):
    return static.merge(leaves).embed(
        ids_BT,
        pixel_values=pixel_values,
        image_grids=image_grids,
        pixel_values_videos=pixel_values_videos,
        video_grids=video_grids,
    )


def decode_step(
    model: LingForCausalLM, state: DecodeState, arrays: SamplingArrays, position_offsets_B=None, real_B=None
) -> tuple[NewTokens, DecodeState]:
    """One decode step of every row (traced inside a jitted program). position_offsets_B: after media, a token in
    cache slot s sits at position s + offset (VL prompts). real_B: the rows that step (None: all); the others'
    input is a pad, which leaves their state (KDA state, conv window, length, seen and counted tokens, token,
    step) as it was, in place: no copy of a row's old state is kept to select from."""
    positions = None if position_offsets_B is None else (state.cache.lengths + position_offsets_B)[:, None]
    mask_B1 = None if real_B is None else real_B[:, None]
    out = model(state.token_B[:, None], cache=state.cache, positions=positions, attention_mask=mask_B1)
    token_B, logprobs = _draw(out.logits[:, 0], arrays, state.steps_B, state.seen_BV, state.counts_BV)
    counted_B, stepped_B = token_B, state.steps_B + 1
    if real_B is not None:  # a pad's token is counted nowhere (past the vocabulary: dropped)
        counted_B = jnp.where(real_B, token_B, state.seen_BV.shape[1])
        stepped_B = jnp.where(real_B, stepped_B, state.steps_B)
    state = state.replace(
        cache=out.cache,
        seen_BV=update_seen(state.seen_BV, counted_B),
        counts_BV=count_tokens(state.counts_BV, counted_B),
        token_B=token_B if real_B is None else jnp.where(real_B, token_B, state.token_B),
        steps_B=stepped_B,
    )
    return _one_token(token_B, logprobs), state


@functools.partial(jax.jit, static_argnames=("static", "num_steps"), donate_argnames="state")
def _decode_group(
    static, num_steps, leaves, state: DecodeState, arrays, position_offsets_B=None
) -> tuple[NewTokens, DecodeState]:
    """num_steps decode steps in one program (a `lax.scan`, each sampled token fed back on the device): their
    tokens [B, num_steps] with their logprobs and the state after the last."""
    model = static.merge(leaves)

    def step(state, _):
        new, state = decode_step(model, state, arrays, position_offsets_B)
        return state, (new.tokens_BT[:, 0], jax.tree.map(lambda x: x[:, 0], new.logprobs))

    state, steps_K = jax.lax.scan(step, state, length=num_steps)
    tokens_BK, logprobs = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), steps_K)
    return NewTokens(tokens_BK, jnp.full(tokens_BK.shape[:1], num_steps, jnp.int32), logprobs), state


def where_rows(rows_B, new, old):
    """`new` in the rows where rows_B [B] holds, `old` elsewhere (arrays of one leading batch axis)."""
    return jnp.where(rows_B.reshape(-1, *([1] * (new.ndim - 1))), new, old)


def _draw_verified(logits_BTV, arrays: SamplingArrays, state: DecodeState, drafts_BK) -> tuple[jax.Array, Logprobs]:
    """The target token [B, T] at each of a verify pass's T = K + 1 positions, with its logprobs, in one `sample`
    call over B * T rows: position i draws with the row's sampler at step steps + i, drafts[:i] seen (they matter
    only if accepted, as seen tokens and as generated-token counts). The drafts before each position are counted
    by comparison with the vocabulary (elementwise: it fuses with the reads of the row's seen and counted tokens,
    no scatter into a buffer of its own)."""
    batch, positions, vocab = logits_BTV.shape
    before_TK = jnp.arange(drafts_BK.shape[1])[None, :] < jnp.arange(positions)[:, None]  # draft k precedes position t
    drafted_BTKV = (drafts_BK[:, None, :, None] == jnp.arange(vocab)) & before_TK[None, :, :, None]
    drafted_BTV = drafted_BTKV.sum(axis=2, dtype=jnp.int32)
    steps_BT = state.steps_B[:, None] + jnp.arange(positions, dtype=state.steps_B.dtype)
    token_N, logprobs = _draw(
        logits_BTV.reshape(batch * positions, vocab),
        jax.tree.map(lambda x: jnp.repeat(x, positions, axis=0), arrays),
        steps_BT.reshape(-1),
        (state.seen_BV[:, None] | (drafted_BTV > 0)).reshape(batch * positions, vocab),
        (state.counts_BV[:, None] + drafted_BTV).reshape(batch * positions, vocab),
    )
    return jax.tree.map(lambda x: x.reshape(batch, positions, *x.shape[1:]), (token_N, logprobs))


def speculative_round(
    model: LingForCausalLM,
    num_drafts: int,
    state: DecodeState,
    arrays: SamplingArrays,
    active_B,
    capacity_B,
    end_bits_BW,
) -> tuple[NewTokens, DecodeState]:
    """Draft num_drafts tokens, verify them, commit (traced inside a jitted program): each active row emits its
    targets up to its first rejected draft (tokens_BT: [B, K+1] targets, counts_B: accepted + 1), and no further
    than its first end token (end_bits_BW [B, W]: each row's, `end_tokens`) or its capacity (capacity_B [B]: the
    prompt and generated tokens it may hold). Rows not active emit nothing and keep their state in place: their
    drafts and verified tokens are pads (the attention mask), which leave their KDA states, caches and lengths as
    they were, and their other rows (seen and counted tokens, token, step, next draft) take no update; no copy of a
    row's old state is kept to select from."""
    cache, seen_BV, token_B, drafts = state.cache, state.seen_BV, state.token_B, state.drafts
    rows = jnp.arange(token_B.shape[0])
    active_B1 = active_B[:, None]
    mtp_cache, draft_hidden_BD = drafts.cache, drafts.draft_hidden_BD
    mtp_lengths_B = mtp_cache.lengths
    chain = [drafts.draft_B]
    for _ in range(num_drafts - 1):
        out = model.draft_logits(
            draft_hidden_BD[:, None], chain[-1][:, None], cache=mtp_cache, attention_mask=active_B1
        )
        mtp_cache, draft_hidden_BD = out.cache, out.hidden[:, 0]
        chain.append(jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32))
    drafts_BK = jnp.stack(chain, axis=1)
    verify_ids = jnp.concatenate([token_B[:, None], drafts_BK], axis=1)
    real_BT = jnp.broadcast_to(active_B1, verify_ids.shape)
    hidden_BTD, steps_cache = model.model(
        verify_ids, cache=cache, attention_mask=real_BT, kda_mode=STEPS, policy=model.policy
    )
    targets_BT, logprobs = _draw_verified(model.logits(hidden_BTD), arrays, state, drafts_BK)
    # draft k is accepted while drafts [0, k] match their targets, none of those targets is an end token and the
    # row has room for target k + 1 too: the first draft that breaks one of these (or K: none) is the count
    room_B = capacity_B - cache.lengths - 1  # tokens the row may still emit
    targets_BK = targets_BT[:, :num_drafts]
    stops_BK = (
        (drafts_BK != targets_BK) | is_end(end_bits_BW, targets_BK) | (jnp.arange(num_drafts) >= room_B[:, None] - 1)
    )
    accepted_B = jnp.argmax(jnp.pad(stops_BK, ((0, 0), (0, 1)), constant_values=True), axis=1).astype(jnp.int32)
    kept_BT = (jnp.arange(num_drafts + 1)[None, :] <= accepted_B[:, None]) & active_B1
    seen_BV = seen_BV.at[rows[:, None], targets_BT].max(kept_BT)
    counts_BV = state.counts_BV.at[rows[:, None], targets_BT].add(kept_BT.astype(jnp.int32))
    cache = commit_verified(steps_cache, accepted_B, num_drafts + 1, active_B)
    mtp_cache = MTPCache(layer=mtp_cache.layer, lengths=mtp_lengths_B)  # drop the chained drafts' entries
    mtp_hidden_BTD, mtp_cache = model.draft_hidden(hidden_BTD, targets_BT, cache=mtp_cache, attention_mask=kept_BT)
    mtp_hidden_BD = mtp_hidden_BTD[rows, accepted_B]  # the accepted position's: the lm_head runs on it alone
    draft_B = jnp.argmax(model.logits(mtp_hidden_BD[:, None])[:, 0], axis=-1).astype(jnp.int32)
    drafts = drafts.replace(
        cache=mtp_cache,
        draft_B=jnp.where(active_B, draft_B, drafts.draft_B),
        draft_hidden_BD=jnp.where(active_B1, mtp_hidden_BD, drafts.draft_hidden_BD),
    )
    stepped = state.replace(
        cache=cache,
        seen_BV=seen_BV,
        counts_BV=counts_BV,
        token_B=jnp.where(active_B, targets_BT[rows, accepted_B], token_B),
        steps_B=state.steps_B + kept_BT.sum(axis=1, dtype=jnp.int32),
        drafts=drafts,
    )
    counts_B = kept_BT.sum(axis=1, dtype=jnp.int32)
    return NewTokens(targets_BT, counts_B, logprobs, rounds_B=active_B.astype(jnp.int32)), stepped


def speculative_rounds(
    model: LingForCausalLM,
    num_drafts: int,
    num_rounds: int,
    state: DecodeState,
    arrays: SamplingArrays,
    active_B,
    capacity_B,
    end_bits_BW,
) -> tuple[NewTokens, DecodeState]:
    """num_rounds speculative rounds in one program (a `lax.fori_loop` of a fixed trip count, traced inside a jitted
    program), with no host in between: each round's accepted tokens go to the row's next columns of a [B,
    num_rounds * (K + 1)] buffer (NewTokens.counts_B: how many each row has; rounds_B: the rounds it ran). A row
    runs a round while active_B, below its capacity (capacity_B: the prompt and generated tokens it may hold) and
    its last token not one of its end tokens (end_bits_BW [B, W], `end_tokens`); a row that stops keeps its state,
    in place (`speculative_round`)."""
    batch, width = state.token_B.shape[0], num_rounds * (num_drafts + 1)
    rows_B1 = jnp.arange(batch)[:, None]

    def round_(_, carry):
        state, out = carry
        ended_B = is_end(end_bits_BW, state.token_B[:, None])[:, 0]
        running_B = active_B & (state.cache.lengths + 1 < capacity_B) & ~ended_B
        new, state = speculative_round(model, num_drafts, state, arrays, running_B, capacity_B, end_bits_BW)
        columns_BT = out.counts_B[:, None] + jnp.arange(num_drafts + 1)
        columns_BT = jnp.where(columns_BT < (out.counts_B + new.counts_B)[:, None], columns_BT, width)  # width: dropped
        tokens_BN, logprobs = jax.tree.map(
            lambda buffer, x: buffer.at[rows_B1, columns_BT].set(x, mode="drop"),
            (out.tokens_BT, out.logprobs),
            (new.tokens_BT, new.logprobs),
        )
        out = NewTokens(tokens_BN, out.counts_B + new.counts_B, logprobs, out.rounds_B + new.rounds_B)
        return state, out

    logits_BV = jax.ShapeDtypeStruct((batch, state.seen_BV.shape[1]), jnp.float32)
    logprobs = jax.eval_shape(token_logprobs, logits_BV, state.token_B, arrays)
    no_rows_B = jnp.zeros((batch,), jnp.int32)
    out = NewTokens(
        jnp.zeros((batch, width), jnp.int32),
        no_rows_B,
        jax.tree.map(lambda x: jnp.zeros((batch, width, *x.shape[1:]), x.dtype), logprobs),
        rounds_B=no_rows_B,
    )
    state, out = jax.lax.fori_loop(0, num_rounds, round_, (state, out))
    return out, state


@functools.partial(jax.jit, static_argnames=("static", "num_drafts", "num_rounds"), donate_argnames="state")
def _speculative_group(
    static, num_drafts, num_rounds, leaves, state: DecodeState, arrays, active_B, capacity_B, end_bits_BW
) -> tuple[NewTokens, DecodeState]:
    model = static.merge(leaves)
    return speculative_rounds(model, num_drafts, num_rounds, state, arrays, active_B, capacity_B, end_bits_BW)


class _Rows:
    """Host-side bookkeeping: tokens per row, EOS / stop / length limits, streaming callbacks. Tokens arrive as a
    [B, G] group (G steps of every row) and are checked with array operations, not one Python step per token."""

    def __init__(self, batch: int, max_new_tokens: int, eos_ids: Collection[int], on_tokens):
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.counts = np.zeros(batch, np.int64)
        self.done = np.zeros(batch, bool)
        self.max_new_tokens = max_new_tokens
        self.eos_ids = np.array(sorted({int(e) for e in eos_ids}), np.int64)
        self.on_tokens = on_tokens

    def add(self, tokens_BG: np.ndarray, lengths_B: np.ndarray | None = None) -> None:
        """Row r's next tokens are tokens_BG[r, :lengths_B[r]] (all G without lengths_B); each row keeps them up to
        its first EOS (excluded) and its length limit. Finished rows take nothing."""
        group = tokens_BG.shape[1]
        lengths_B = np.full(len(self.done), group) if lengths_B is None else lengths_B
        eos_BG = np.isin(tokens_BG, self.eos_ids) & (np.arange(group)[None, :] < lengths_B[:, None])
        first_eos_B = np.where(eos_BG.any(axis=1), eos_BG.argmax(axis=1), lengths_B)
        room_B = self.max_new_tokens - self.counts
        kept_B = np.where(self.done, 0, np.minimum(first_eos_B, room_B))
        self.done |= (first_eos_B < lengths_B) | (room_B <= lengths_B)
        self.counts += kept_B
        for row in np.flatnonzero(kept_B):
            kept = tokens_BG[row, : kept_B[row]].tolist()
            self.tokens[row].extend(kept)
            if self.on_tokens is not None and self.on_tokens(int(row), kept):
                self.done[row] = True

    @property
    def generated(self) -> int:
        return int(self.counts.sum())

    def room(self) -> np.ndarray:
        """The tokens each row not done may still take (0 for rows done)."""
        return np.where(self.done, 0, self.max_new_tokens - self.counts)


class _SteadyClock:
    """Times the decode after its first program (which compiles on a first call): `tick(steps)` once a
    program's tokens are on the host. The first tick starts the clock; the steps of later ticks are timed, less
    any compilation between them (`compile_clock`: a program compiled again, e.g. for a new input layout)."""

    def __init__(self, rows: _Rows, compile_clock: CompileClock):
        self.rows, self.compile_clock = rows, compile_clock
        self.ticked = False
        self.steps = 0
        self.start = self.end = 0.0
        self.start_tokens = self.end_tokens = 0
        self.compiled_start = self.compiled_end = 0.0

    def tick(self, steps: int = 1) -> None:
        """A program of `steps` decode steps (or one MTP round) has just brought its tokens to the host."""
        now, tokens, compiled = time.perf_counter(), self.rows.generated, self.compile_clock.seconds
        if self.ticked:
            self.steps += steps
        else:
            self.ticked, self.start, self.start_tokens, self.compiled_start = True, now, tokens, compiled
        self.end, self.end_tokens, self.compiled_end = now, tokens, compiled

    def record(self, stats: GenerationStats) -> None:
        stats.steady_steps = self.steps
        stats.steady_tokens = self.end_tokens - self.start_tokens
        stats.steady_s = self.end - self.start - (self.compiled_end - self.compiled_start)


def cache_length(prompt_slots: int, max_new_tokens: int, mtp: int) -> int:
    """Cache slots for a left-padded prompt of `prompt_slots` columns and its decode, rounded up to CACHE_BUCKET.
    Decode runs whole DECODE_READ_GROUP programs, up to DECODE_READ_GROUP - 1 steps past the last token kept; an
    MTP round appends up to mtp + 1 tokens."""
    slack = mtp + 1 if mtp else DECODE_READ_GROUP - 1
    return -(-(prompt_slots + max_new_tokens + slack) // CACHE_BUCKET) * CACHE_BUCKET


def default_prefill_chunk(rows: int) -> int:
    """generate.py's --prefill-chunk for `rows` prompts: PREFILL_TOKENS a call split over the rows (rounded up to a
    power of two), at least LEAST_DEFAULT_CHUNK a row. Each call re-reads every weight, so on a large model fewer,
    longer calls prefill faster; at 4+ rows the chunk stays 2048, whose memory the earlier default already took."""
    return max(LEAST_DEFAULT_CHUNK, PREFILL_TOKENS // _power_of_two_at_least(rows))


def _power_of_two_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (max(n, 1) - 1).bit_length()


def prefill_chunks(longest: int, chunk: int) -> list[int]:
    """Chunk lengths covering a left-padded prompt of >= `longest` tokens: a head of powers of two for the tokens
    past the whole chunks (few compiled shapes), then full chunks. The head is one power of two, or, past
    LEAST_DEFAULT_CHUNK, two where two pad less (5,000 tokens: 4096 + 1024 rather than 8192; a call costs a read of
    every weight and a shorter head a compile of its own, so never three, nor two for short heads)."""
    full, rest = divmod(longest, chunk)
    if not rest:
        return [chunk] * full
    one = min(chunk, max(MIN_CHUNK, _power_of_two_at_least(rest)))
    low = 1 << (rest.bit_length() - 1)  # the largest power of two <= rest
    split = one > LEAST_DEFAULT_CHUNK and low < rest
    two = [low, max(MIN_CHUNK, _power_of_two_at_least(rest - low))] if split else []
    head = two if two and sum(two) < one else [one]
    return head + [chunk] * full


@dataclasses.dataclass(frozen=True)
class MediaInputs:
    """Images and videos of a VL batch: each row's grids in prompt order; pixel values of every row's media
    concatenated in row order ([N, patch_dim], `ling_jax.vl.image_processing`)."""

    image_grids: tuple[tuple[MediaGrid, ...], ...] = ()
    pixel_values: np.ndarray | None = None
    video_grids: tuple[tuple[MediaGrid, ...], ...] = ()
    pixel_values_videos: np.ndarray | None = None


def media_prefill_inputs(static, leaves, vl_config, ids_BT, mask_BT, media: MediaInputs):
    """A VL batch's merged embeddings [B, T, D], (t, h, w) positions [B, T, 3] and per-row position offsets [B]
    for its (padded) prompt ids and mask (host arrays); the model is `static.merge(leaves)`. Shared by
    `Generator` and the server's engine."""
    batch = ids_BT.shape[0]
    image_grids = media.image_grids or ((),) * batch
    video_grids = media.video_grids or ((),) * batch
    positions, deltas = batch_mrope_positions(
        ids_BT,
        mask_BT,
        image_grids,
        video_grids,
        image_token_id=vl_config.image_token_id,
        video_token_id=vl_config.video_token_id,
        spatial_merge_size=vl_config.vision.spatial_merge_size,
    )
    embeds = _media_embeddings(
        static, leaves, jnp.asarray(ids_BT), media.pixel_values, image_grids, media.pixel_values_videos, video_grids
    )
    return embeds, jnp.asarray(positions, jnp.int32), jnp.asarray(deltas, jnp.int32)


class Generator:
    """Generates continuations of token-id prompts with `model` (optionally sharded over `mesh`); a VL model
    also takes images and videos (`MediaInputs`)."""

    def __init__(
        self, model: LingForCausalLM, *, mesh: jax.sharding.Mesh | None = None, prefill_chunk: int = 2048, mtp: int = 0
    ):
        if prefill_chunk < MIN_CHUNK:
            raise ValueError(f"--prefill-chunk must be >= {MIN_CHUNK}, got {prefill_chunk}")
        if mtp < 0:
            raise ValueError(f"--mtp must be >= 0, got {mtp}")
        if mtp and not model.config.num_nextn_predict_layers:
            raise ValueError("--mtp needs a model with an MTP layer (num_nextn_predict_layers = 1); this one has none")
        self.config = model.config
        self.vl_config = getattr(model, "vl_config", None)
        self.dtype = model.dtype
        self.mesh = mesh
        self.prefill_chunk = prefill_chunk
        self.mtp = mtp
        if mesh is not None:
            shard_model(model, mesh)
        self.static, self.leaves = split_model(model)

    def _place(self, cache):
        if self.mesh is None:
            return cache
        return jax.device_put(cache, cache_shardings(cache, self.mesh))

    def _check(self, prompts: Sequence[Sequence[int]], sampling: Sequence[SamplingParams], max_new_tokens: int):
        if not prompts:
            raise ValueError("no prompts given")
        if len(sampling) != len(prompts):
            raise ValueError(f"{len(sampling)} sampling settings for {len(prompts)} prompts")
        if max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        for row, prompt in enumerate(prompts):
            if not len(prompt):
                raise ValueError(f"prompt {row} is empty: every prompt needs at least one token")
            bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt {row} has token ids outside [0, {self.config.vocab_size}): {bad[:5]}")
            limit = self.config.max_position_embeddings
            if len(prompt) + max_new_tokens > limit:
                raise ValueError(
                    f"prompt {row} has {len(prompt)} tokens; with --max-new-tokens {max_new_tokens} "
                    f"that exceeds the model's context of {limit} tokens"
                )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[SamplingParams],
        max_new_tokens: int,
        *,
        eos_ids: Collection[int] = (),
        on_tokens: Callable[[int, list[int]], bool] | None = None,
        media: MediaInputs | None = None,
    ) -> tuple[list[list[int]], GenerationStats]:
        """New tokens per prompt (EOS excluded) and timing stats. on_tokens(row, ids) streams them as they
        arrive; returning True stops that row (e.g. a stop string). media: the prompts' images and videos, whose
        pad tokens the prompts hold (VL models only)."""
        self._check(prompts, sampling, max_new_tokens)
        if media is not None:
            self._check_media(media, len(prompts))
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext(), CompileClock() as clock:
            tokens, stats = self._generate(prompts, sampling, max_new_tokens, eos_ids, on_tokens, media, clock)
        stats.compile_s = clock.seconds
        return tokens, stats

    def _check_media(self, media: MediaInputs, batch: int) -> None:
        if self.vl_config is None:
            raise ValueError("images and videos need a VL model (a checkpoint with a vision_config)")
        if self.mtp:
            raise ValueError("--mtp is not supported with images or videos (the VL model's MTP is not wired up)")
        for grids, what in ((media.image_grids, "image"), (media.video_grids, "video")):
            if grids and len(grids) != batch:
                raise ValueError(f"{what} grids are given for {len(grids)} rows, there are {batch} prompts")

    def _generate(self, prompts, sampling, max_new_tokens, eos_ids, on_tokens, media, clock: CompileClock):
        batch = len(prompts)
        chunks = prefill_chunks(max(len(p) for p in prompts), self.prefill_chunk)
        padded = sum(chunks)
        ids = np.zeros((batch, padded), np.int32)
        mask = np.zeros((batch, padded), bool)
        for row, prompt in enumerate(prompts):
            ids[row, padded - len(prompt) :] = prompt
            mask[row, padded - len(prompt) :] = True
        next_ids = np.concatenate([ids[:, 1:], np.zeros((batch, 1), np.int32)], axis=1)
        mtp_mask = mask & (np.arange(padded) < padded - 1)[None, :]
        max_length = cache_length(padded, max_new_tokens, self.mtp)
        drafts = None
        if self.mtp:
            drafts = Drafts.create(self.config, batch, max_length, self.dtype)
            drafts = drafts.replace(cache=self._place(drafts.cache))
        state = DecodeState.create(
            self._place(LingCache.create(self.config, batch, max_length, self.dtype)),
            seen_from_prompts(jnp.asarray(ids), jnp.asarray(mask), self.config.vocab_size),
            drafts,
        )
        arrays = SamplingArrays.from_params(sampling, specialise=True)  # a program per mix of sampling steps used
        rows = _Rows(batch, max_new_tokens, eos_ids, on_tokens)

        start, compiled_before = time.perf_counter(), clock.seconds
        embeds = positions = offsets = None
        if media is not None:
            inputs = media_prefill_inputs(self.static, self.leaves, self.vl_config, ids, mask, media)
            embeds, positions, offsets = inputs
        offset = 0
        for length in chunks:
            part = slice(offset, offset + length)
            last_hidden, state = _prefill_chunk(
                self.static,
                self.leaves,
                state,
                ids[:, part],
                mask[:, part],
                next_ids[:, part],
                mtp_mask[:, part],
                None if embeds is None else embeds[:, part],
                None if positions is None else positions[:, part],
            )
            # no chunk runs during the next call's compilation, so prefill_s less compile time is the prefill's
            jax.block_until_ready(last_hidden)
            offset += length
        first, state = _first_token(self.static, self.leaves, state, last_hidden, arrays)
        first_BT = np.asarray(first.tokens_BT)
        ttft = time.perf_counter() - start
        rows.add(first_BT)
        stats = GenerationStats(
            prompt_tokens=int(mask.sum()),
            generated_tokens=0,
            prefill_s=ttft,
            decode_s=0.0,
            ttft_s=ttft,
            prefill_compile_s=clock.seconds - compiled_before,
        )
        steady = _SteadyClock(rows, clock)
        start = time.perf_counter()
        if self.mtp:
            self._speculate(rows, stats, steady, state, arrays)
        else:
            self._decode(rows, steady, state, arrays, offsets)
        stats.decode_s = time.perf_counter() - start
        steady.record(stats)
        stats.generated_tokens = rows.generated
        return rows.tokens, stats

    def _decode(self, rows: _Rows, steady: _SteadyClock, state: DecodeState, arrays, position_offsets):
        """After the first token, each jitted program runs DECODE_READ_GROUP decode steps on the device and returns
        their tokens [B, K], and the host reads one program's tokens at a time. The next program is dispatched
        before the host reads, so the device computes it while the host does the group's work (bookkeeping,
        detokenising, printing); each program's tokens are copied to the host as soon as it ends
        (`copy_to_host_async`), so a read waits for its own program only. Programs always run whole (the cache
        has room for the steps past max_new_tokens, `cache_length`), and the host keeps no token past
        max_new_tokens or a row's end (EOS, stop)."""
        remaining = rows.max_new_tokens - 1
        if remaining == 0 or rows.done.all():
            return
        group = functools.partial(_decode_group, self.static, DECODE_READ_GROUP, self.leaves)
        programs = -(-remaining // DECODE_READ_GROUP)
        queued: list[jax.Array] = []  # [B, K] tokens of programs dispatched, not yet read, oldest first
        for program in range(programs):
            while len(queued) < min(2, programs - program):  # this program and the next one
                new, state = group(state, arrays, position_offsets)
                new.tokens_BT.copy_to_host_async()
                queued.append(new.tokens_BT)
            kept = min(DECODE_READ_GROUP, remaining - program * DECODE_READ_GROUP)
            rows.add(np.asarray(queued.pop(0))[:, :kept])
            steady.tick(DECODE_READ_GROUP)
            if rows.done.all():
                return

    def _speculate(self, rows: _Rows, stats: GenerationStats, steady: _SteadyClock, state: DecodeState, arrays):
        """After the first token, each jitted program runs DECODE_READ_GROUP speculative rounds on the device
        (`speculative_rounds`: rows stop at their EOS or length limit there) and the host reads one program's
        tokens at a time, as `_decode` does: the next program is dispatched before the host reads, unless the ones
        dispatched surely end every row (each round gives a running row at least one token). A row the host stops
        (a stop string) stops at the next program dispatched."""
        if rows.done.all():
            return
        group = functools.partial(_speculative_group, self.static, self.mtp, DECODE_READ_GROUP, self.leaves)
        capacity_B = state.cache.lengths + rows.max_new_tokens  # each row's prompt and first token hold lengths + 1
        end_bits_BW = jnp.asarray(end_bitmask([rows.eos_ids] * len(rows.done), self.config.vocab_size))
        queued: list[NewTokens] = []  # programs dispatched, not yet read, oldest first
        while not rows.done.all():
            while len(queued) < 2 and not (queued and rows.room().max() <= DECODE_READ_GROUP * len(queued)):
                new, state = group(state, arrays, jnp.asarray(~rows.done), capacity_B, end_bits_BW)
                for part in jax.tree.leaves(new):
                    part.copy_to_host_async()
                queued.append(new)
            new = jax.device_get(queued.pop(0))
            stats.drafted += self.mtp * int(new.rounds_B.sum())
            stats.accepted += int((new.counts_B - new.rounds_B).sum())
            rows.add(new.tokens_BT, new.counts_B)
            steady.tick(int(new.rounds_B.max()))
