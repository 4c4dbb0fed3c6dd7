"""Per-request sampling for a jitted decode step.

Every row of a batch carries its own parameters (`SamplingArrays`, [B] arrays), so changing them never
recompiles. `sample` processes the logits in float32, in the order of transformers' `generate`, after a grammar's token
bitmask (`grammar_mask.mask_logits`: -inf on the tokens a row's grammar forbids; ling-serve's structured outputs):

1. repetition penalty on every token already seen (prompt or output), the CTRL / transformers rule: a
   positive logit is divided by the penalty, a negative one multiplied;
2. OpenAI's logit controls (`logit_controls.py`): presence / frequency penalties over the generated tokens'
   counts, logit bias, and the end tokens held back until `min_tokens`;
3. temperature (0 = greedy: the row takes the argmax of the logits after steps 1-2 and ignores its key and
   every filter below);
4. top-k: keep the tokens whose logit is >= the k-th largest;
5. top-p: over the softmax of what top-k kept, keep the smallest prefix of the sorted probabilities whose
   sum reaches p (the top token always stays);
6. min-p: drop tokens whose probability is below min_p times the largest one;
7. a categorical draw (Gumbel-max) from the softmax of what is left.

vLLM applies min-p before top-k / top-p; since min-p compares ratios to the top probability, the two orders
differ only in which probabilities top-p sums. Top-k and top-p are applied as a per-row logit threshold, so
tokens tied with the last kept one are kept too: which of equal logits survive never depends on token ids
(transformers' top-k does the same; its top-p cuts ties in sort order, which matters only for exact ties).

Cost: top-k / top-p need the row's k-th largest logit and top-p's cutoff, each a search over the row
(`order_stats`: 11 fused passes over the [B, V] logits, no sort, which on a GPU would keep a decode program's
loop out of XLA's command buffers). It is skipped with a `lax.cond` when no sampled row of the batch uses either
filter, and the whole draw (the [B, V] Gumbel noise included) when every row is greedy. Both branches of each
cond give the same token for a row that does not need the skipped work, so a request's output does not depend on
the other rows of its batch: its randomness comes from its own key, fold_in(key(seed), step), with `step` its own
token count.

Logprobs (`token_logprobs`, OpenAI's `logprobs`): the log-softmax of the raw float32 logits (before the penalty,
temperature and filters, as vLLM reports them by default) at the drawn token and at the row's MAX_LOGPROBS most
likely tokens. A row asks with `SamplingParams.logprobs` (how many alternatives it reports, 0 to MAX_LOGPROBS);
the batch computes them for every row when any row asks (a log-softmax and one top-k of MAX_LOGPROBS over
[B, V], by search as above, small next to the model's step; per row they would need a gather of the asking rows,
a shape that changes with the batch) and is skipped with a `lax.cond` when none does.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ling_jax.generation import order_stats
from ling_jax.generation.grammar_mask import mask_logits, unconstrained
from ling_jax.generation.logit_controls import LogitControls, apply_logit_controls, check_controls
from ling_jax.generation.sampling_features import GENERAL, SamplingFeatures, when_used

SEED_LIMIT = 2**32  # seeds become uint32 key data
MAX_LOGPROBS = 20  # the most alternatives per token a request can ask for (OpenAI's limit)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampling parameters; the defaults switch every filter off and sample at temperature 1."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int = 0
    logprobs: int | None = None  # the top alternatives each token reports with its logprob; None = no logprobs
    presence_penalty: float = 0.0  # 0 = off (OpenAI's, over the generated tokens)
    frequency_penalty: float = 0.0  # 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # the end tokens (`end_ids`) are held back until this many tokens are generated
    end_ids: tuple[int, ...] = ()  # EOS and stop token ids: what min_tokens holds back

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError, naming the command-line flag, for a value out of range."""
        _check_real("--temperature", self.temperature, 0.0 <= self.temperature, "must be >= 0")
        if not isinstance(self.top_k, numbers.Integral) or self.top_k < 0:
            raise ValueError(f"--top-k must be an integer >= 0 (0 = off), got {self.top_k}")
        _check_real("--top-p", self.top_p, 0.0 < self.top_p <= 1.0, "must be in (0, 1]")
        _check_real("--min-p", self.min_p, 0.0 <= self.min_p <= 1.0, "must be in [0, 1]")
        _check_real("--repetition-penalty", self.repetition_penalty, 0.0 < self.repetition_penalty, "must be > 0")
        if not isinstance(self.seed, numbers.Integral) or not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"--seed must be an integer in [0, 2**32), got {self.seed}")
        wrong = not isinstance(self.logprobs, numbers.Integral) or not 0 <= self.logprobs <= MAX_LOGPROBS
        if self.logprobs is not None and wrong:
            raise ValueError(f"--logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        check_controls(self)


def _check_real(flag: str, value, in_range: bool, rule: str) -> None:
    if not isinstance(value, numbers.Real) or not math.isfinite(value) or not in_range:
        raise ValueError(f"{flag} {rule}, got {value}")


@struct.dataclass
class SamplingArrays:
    """The sampling parameters of a batch, one row per request: a pytree of [B] arrays for `sample`."""

    temperature: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32
    top_p: jax.Array  # [B] float32
    min_p: jax.Array  # [B] float32
    repetition_penalty: jax.Array  # [B] float32
    seed: jax.Array  # [B] uint32
    logprobs: jax.Array  # [B] int32: alternatives the row reports, -1 = no logprobs
    controls: LogitControls
    # [B, ceil(V / 32)] int32: each row's allowed tokens (`grammar_mask`; all bits set: any), or None: no grammars
    token_bitmask_BW: jax.Array | None = None
    # the steps a program traced with these arrays keeps (static: part of the program's identity)
    features: SamplingFeatures = struct.field(pytree_node=False, default=GENERAL)

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        vocab_size: int | None = None,
        specialise: bool = False,
        host: bool = False,
    ) -> SamplingArrays:
        """vocab_size: give the batch token bitmasks (every token allowed), for grammars (ling-serve). specialise:
        a program traced with these arrays leaves out the steps no row of `params` uses (`SamplingFeatures.of`; a
        program per mix of steps); otherwise it keeps each behind its `lax.cond` (one program for any parameters).
        The arrays go to the device in one transfer; host: left as numpy arrays (the caller places them)."""
        if not params:
            raise ValueError("SamplingArrays needs the parameters of at least one request")

        def column(name: str, dtype) -> np.ndarray:
            return np.array([getattr(p, name) for p in params], dtype)

        arrays = cls(
            temperature=column("temperature", np.float32),
            top_k=column("top_k", np.int32),
            top_p=column("top_p", np.float32),
            min_p=column("min_p", np.float32),
            repetition_penalty=column("repetition_penalty", np.float32),
            seed=column("seed", np.uint32),
            logprobs=np.array([-1 if p.logprobs is None else p.logprobs for p in params], np.int32),
            controls=LogitControls.from_params(params, host=True),
            token_bitmask_BW=None if vocab_size is None else unconstrained(len(params), vocab_size),
            features=SamplingFeatures.of(params, grammar=vocab_size is not None) if specialise else GENERAL,
        )
        return arrays if host else jax.device_put(arrays)


@struct.dataclass
class Logprobs:
    """Each drawn token's logprob and the row's MAX_LOGPROBS most likely tokens with theirs, most likely first
    ([B] and [B, K] from `token_logprobs`; a program's `NewTokens` holds them per token, [B, T] and [B, T, K]).
    Zeros in a batch where no row asks."""

    chosen: jax.Array  # float32
    top_ids: jax.Array  # int32
    top: jax.Array  # float32


def seen_from_prompts(ids_BT: jax.Array, mask_BT: jax.Array, vocab_size: int) -> jax.Array:
    """[B, V] bool: which tokens occur among the real (mask = 1) positions of each prompt."""
    batch = ids_BT.shape[0]
    rows_BT = jnp.broadcast_to(jnp.arange(batch)[:, None], ids_BT.shape)
    ids_or_dropped_BT = jnp.where(mask_BT, ids_BT, vocab_size)  # pads point past the vocabulary: dropped
    seen_BV = jnp.zeros((batch, vocab_size), bool)
    return seen_BV.at[rows_BT, ids_or_dropped_BT].set(True, mode="drop")


def update_seen(seen_BV: jax.Array, tokens_B: jax.Array) -> jax.Array:
    """Mark each row's new token as seen."""
    return seen_BV.at[jnp.arange(seen_BV.shape[0]), tokens_B].set(True)


def apply_repetition_penalty(logits_BV: jax.Array, seen_BV: jax.Array, penalty_B: jax.Array) -> jax.Array:
    """Seen tokens: positive logits divided by the row's penalty, negative ones multiplied (CTRL rule)."""
    penalty_B1 = penalty_B[:, None]
    penalised_BV = jnp.where(logits_BV > 0, logits_BV / penalty_B1, logits_BV * penalty_B1)
    return jnp.where(seen_BV, penalised_BV, logits_BV)


def request_keys(seed_B: jax.Array, steps_B: jax.Array) -> jax.Array:
    """Each row's PRNG key for this step: fold_in(key(seed), step), independent of the rest of the batch."""
    steps_B = jnp.broadcast_to(jnp.asarray(steps_B, jnp.int32), seed_B.shape)
    return jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(seed_B, steps_B)


def process_logits(
    logits_BV: jax.Array, arrays: SamplingArrays, seen_BV: jax.Array, counts_BV: jax.Array | None = None, steps_B=0
) -> jax.Array:
    """The float32 logits each row draws from (steps 1-6 of the module doc), -inf where filtered out.

    Greedy rows get their penalised logits, unscaled and unfiltered (their argmax is their token).
    """
    return _temperature_and_filters(_penalised(logits_BV, arrays, steps_B, seen_BV, counts_BV), arrays)


def _penalised(logits_BV, arrays: SamplingArrays, steps_B, seen_BV, counts_BV) -> jax.Array:
    """The grammar's bitmask, then steps 1-2 of the module doc, in float32."""
    logits_BV = mask_logits(logits_BV, arrays.token_bitmask_BW, arrays.features.grammar)
    penalised_BV = apply_repetition_penalty(logits_BV.astype(jnp.float32), seen_BV, arrays.repetition_penalty)
    return apply_logit_controls(penalised_BV, arrays.controls, steps_B, counts_BV, arrays.features)


def sample(
    logits_BV: jax.Array,
    arrays: SamplingArrays,
    steps_B: jax.Array,
    seen_BV: jax.Array,
    counts_BV: jax.Array | None = None,
) -> jax.Array:
    """Next token of every row, int32 [B]. Pure jnp, jit-able.

    steps_B: [B] (or a scalar) int, how many tokens each request has generated so far; with the row's seed it
    makes the row's key. seen_BV: [B, V] bool, the tokens the repetition penalty applies to. counts_BV: [B, V]
    int32, how often each row generated each token (the presence / frequency penalties'; None: no token yet).
    """
    penalised_BV = _penalised(logits_BV, arrays, steps_B, seen_BV, counts_BV)
    greedy_B = arrays.temperature == 0

    def draw():
        processed_BV = _temperature_and_filters(penalised_BV, arrays)
        vocab = processed_BV.shape[-1]
        keys_B = request_keys(arrays.seed, steps_B)
        gumbel_BV = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(keys_B)
        return jnp.argmax(jnp.where(greedy_B[:, None], processed_BV, processed_BV + gumbel_BV), axis=-1)

    tokens_B = when_used(arrays.features.sampled, ~jnp.all(greedy_B), draw, lambda: jnp.argmax(penalised_BV, axis=-1))
    return tokens_B.astype(jnp.int32)


def token_logprobs(logits_BV: jax.Array, tokens_B: jax.Array, arrays: SamplingArrays) -> Logprobs:
    """The log-softmax of each row's raw logits at its token `tokens_B` and at its top MAX_LOGPROBS tokens, computed
    when any row of the batch asks (`arrays.logprobs` >= 0)."""
    batch, vocab = logits_BV.shape
    k = min(MAX_LOGPROBS, vocab)

    def skip() -> Logprobs:
        zeros_BK = jnp.zeros((batch, k), jnp.float32)
        return Logprobs(jnp.zeros((batch,), jnp.float32), jnp.zeros((batch, k), jnp.int32), zeros_BK)

    return when_used(
        arrays.features.logprobs, jnp.any(arrays.logprobs >= 0), lambda: logprobs_at(logits_BV, tokens_B), skip
    )


def logprobs_at(logits_BV: jax.Array, tokens_B: jax.Array, top_k=order_stats.top_k) -> Logprobs:
    """The log-softmax of each row's raw logits at its token and at its top MAX_LOGPROBS tokens. top_k: how they
    are found (`order_stats.top_k`, no sort: a decode step's few rows; `jax.lax.top_k` for a prompt's many)."""
    logprobs_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
    top_BK, top_ids_BK = top_k(logprobs_BV, min(MAX_LOGPROBS, logprobs_BV.shape[-1]))
    chosen_B = jnp.take_along_axis(logprobs_BV, tokens_B[:, None], axis=-1)[:, 0]
    return Logprobs(chosen_B, top_ids_BK.astype(jnp.int32), top_BK)


def _temperature_and_filters(penalised_BV: jax.Array, arrays: SamplingArrays) -> jax.Array:
    greedy_B = arrays.temperature == 0
    scaled_BV = penalised_BV / jnp.where(greedy_B, 1.0, arrays.temperature)[:, None]
    truncated_B = ~greedy_B & ((arrays.top_k > 0) | (arrays.top_p < 1))
    cutoff_B1 = when_used(
        arrays.features.truncated,
        jnp.any(truncated_B),
        lambda: _top_k_top_p_cutoff(scaled_BV, arrays.top_k, arrays.top_p),
        lambda: jnp.full((scaled_BV.shape[0], 1), -jnp.inf, jnp.float32),
    )
    max_B1 = jnp.max(scaled_BV, axis=-1, keepdims=True)
    kept_BV = (scaled_BV >= cutoff_B1) & (jnp.exp(scaled_BV - max_B1) >= arrays.min_p[:, None])
    return jnp.where(kept_BV | greedy_B[:, None], scaled_BV, -jnp.inf)


def _top_k_top_p_cutoff(scaled_BV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """[B, 1]: the smallest logit top-k then top-p keep; rows with both off keep everything."""
    vocab = scaled_BV.shape[-1]
    k_B = jnp.where((top_k_B > 0) & (top_k_B < vocab), top_k_B, vocab)
    # each search only where some row filters by it (top-k off: its k-th largest is the row's smallest)
    kth_largest_B = jax.lax.cond(
        jnp.any(k_B < vocab),
        lambda: order_stats.kth_largest(scaled_BV, k_B),
        lambda: jnp.min(scaled_BV, axis=-1).astype(jnp.float32),
    )
    return jax.lax.cond(
        jnp.any(top_p_B < 1),
        lambda: order_stats.top_p_cutoff(scaled_BV, kth_largest_B, top_p_B),
        lambda: kth_largest_B,
    )[:, None]
