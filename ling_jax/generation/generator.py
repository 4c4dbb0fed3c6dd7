"""Batched generation: chunked prefill, then fixed-shape jitted decode programs of DECODE_READ_GROUP steps each
(or MTP speculative rounds) over donated caches, with per-request sampling and streaming callbacks.

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
DECODE_READ_GROUP = 8  # decode steps per program and host read; the next program runs on the device meanwhile
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
    """What a program gives each row: its new tokens are tokens_BT[b, :counts_B[b]] (one per decode step, one to
    K + 1 per speculative round), with their logprobs (`sampling.token_logprobs`: [B, T] and [B, T, K])."""

    tokens_BT: jax.Array  # [B, T] int32
    counts_B: jax.Array  # [B] int32
    logprobs: Logprobs


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
    model: LingForCausalLM, state: DecodeState, arrays: SamplingArrays, position_offsets_B=None
) -> tuple[NewTokens, DecodeState]:
    """One decode step of every row (traced inside a jitted program). position_offsets_B: after media, a token in
    cache slot s sits at position s + offset (VL prompts)."""
    positions = None if position_offsets_B is None else (state.cache.lengths + position_offsets_B)[:, None]
    out = model(state.token_B[:, None], cache=state.cache, positions=positions)
    token_B, logprobs = _draw(out.logits[:, 0], arrays, state.steps_B, state.seen_BV, state.counts_BV)
    state = state.replace(
        cache=out.cache,
        seen_BV=update_seen(state.seen_BV, token_B),
        counts_BV=count_tokens(state.counts_BV, token_B),
        token_B=token_B,
        steps_B=state.steps_B + 1,
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


def speculative_round(
    model: LingForCausalLM, num_drafts: int, state: DecodeState, arrays: SamplingArrays, active_B
) -> tuple[NewTokens, DecodeState]:
    """Draft num_drafts tokens, verify them, commit (traced inside a jitted program): each row emits its targets up
    to its first rejected draft (tokens_BT: [B, K+1] targets, counts_B: accepted + 1). Rows not active keep their
    cache and MTP cache lengths (finished rows never run past the cache; a server's idle slots stay where they
    are)."""
    cache, seen_BV, token_B, drafts = state.cache, state.seen_BV, state.token_B, state.drafts
    rows = jnp.arange(token_B.shape[0])
    mtp_cache, draft_hidden_BD = drafts.cache, drafts.draft_hidden_BD
    mtp_lengths_B = mtp_cache.lengths
    chain = [drafts.draft_B]
    for _ in range(num_drafts - 1):
        out = model.draft_logits(draft_hidden_BD[:, None], chain[-1][:, None], cache=mtp_cache)
        mtp_cache, draft_hidden_BD = out.cache, out.hidden[:, 0]
        chain.append(jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32))
    drafts_BK = jnp.stack(chain, axis=1)
    verify_ids = jnp.concatenate([token_B[:, None], drafts_BK], axis=1)
    start_lengths_B = cache.lengths
    hidden_BTD, steps_cache = model.model(verify_ids, cache=cache, kda_mode=STEPS, policy=model.policy)
    logits_BTV = model.logits(hidden_BTD)
    drawn, seen, counts = [], seen_BV, state.counts_BV
    for i in range(num_drafts + 1):  # position i sees drafts[:i] as history (they matter only if accepted)
        drawn.append(_draw(logits_BTV[:, i], arrays, state.steps_B + i, seen, counts))
        if i < num_drafts:
            seen, counts = update_seen(seen, drafts_BK[:, i]), count_tokens(counts, drafts_BK[:, i])
    targets_BT, logprobs = jax.tree.map(lambda *x: jnp.stack(x, axis=1), *drawn)
    accepted_B = jnp.cumprod(drafts_BK == targets_BT[:, :num_drafts], axis=1).sum(axis=1, dtype=jnp.int32)
    kept_BT = jnp.arange(num_drafts + 1)[None, :] <= accepted_B[:, None]
    seen_BV = seen_BV.at[rows[:, None], targets_BT].max(kept_BT)
    counts_BV = state.counts_BV.at[rows[:, None], targets_BT].add(kept_BT.astype(jnp.int32))
    cache = commit_verified(steps_cache, accepted_B, num_drafts + 1)
    cache = cache.replace(lengths=jnp.where(active_B, cache.lengths, start_lengths_B))
    mtp_cache = MTPCache(layer=mtp_cache.layer, lengths=mtp_lengths_B)  # drop the chained drafts' entries
    out = model.draft_logits(hidden_BTD, targets_BT, cache=mtp_cache, attention_mask=kept_BT & active_B[:, None])
    drafts = drafts.replace(
        cache=out.cache,
        draft_B=jnp.argmax(out.logits[rows, accepted_B], axis=-1).astype(jnp.int32),
        draft_hidden_BD=out.hidden[rows, accepted_B],
    )
    state = state.replace(
        cache=cache,
        seen_BV=seen_BV,
        counts_BV=counts_BV,
        token_B=targets_BT[rows, accepted_B],
        steps_B=state.steps_B + accepted_B + 1,
        drafts=drafts,
    )
    return NewTokens(targets_BT, accepted_B + 1, logprobs), state


@functools.partial(jax.jit, static_argnames=("static", "num_drafts"), donate_argnames="state")
def _speculative_round(
    static, num_drafts, leaves, state: DecodeState, arrays, active_B
) -> tuple[NewTokens, DecodeState]:
    return speculative_round(static.merge(leaves), num_drafts, state, arrays, active_B)


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


def prefill_chunks(longest: int, chunk: int) -> list[int]:
    """Chunk lengths covering a left-padded prompt of >= `longest` tokens: a power-of-two head, then full chunks."""
    full, rest = divmod(longest, chunk)
    head = [min(chunk, max(MIN_CHUNK, 1 << (rest - 1).bit_length()))] if rest else []
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
        arrays = SamplingArrays.from_params(sampling)
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
        while not rows.done.all():
            active = ~rows.done
            new, state = _speculative_round(self.static, self.mtp, self.leaves, state, arrays, jnp.asarray(active))
            counts = np.asarray(new.counts_B)
            stats.drafted += self.mtp * int(active.sum())
            stats.accepted += int((counts - 1)[active].sum())
            rows.add(np.asarray(new.tokens_BT), counts)
            steady.tick()
