"""OpenAI's per-request logit controls, applied to each row's float32 logits on the device before temperature
(step 2 of `sampling.sample`'s order), greedy rows included:

1. presence / frequency penalties (OpenAI's definition): logits[v] -= presence * (count[v] > 0) +
   frequency * count[v], count[v] the times the row has generated token v (its prompt does not count; the
   repetition penalty is the one that sees the prompt);
2. logit bias: up to MAX_LOGIT_BIAS (token id, bias) pairs per row, each bias added to its token's logit;
3. min tokens: until the row has generated `min_tokens` tokens, its end tokens (EOS and stop token ids,
   `SamplingParams.end_ids`) get -inf, so it cannot end before.

Every row carries its controls as fixed-shape arrays (`LogitControls`: the bias and the end tokens as id lists
padded with an id past every vocabulary, which the scatters drop), so changing them never recompiles. Each
control is skipped with a `lax.cond` when no row of the batch uses it (both branches give the same logits to a
row that does not), so rows without controls pay nothing but the three predicates.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ling_jax.generation.sampling_features import GENERAL, SamplingFeatures, when_used

if TYPE_CHECKING:
    from ling_jax.generation.sampling import SamplingParams

MAX_LOGIT_BIAS = 300  # (token, bias) pairs per request: OpenAI's limit
MAX_BIAS = 100.0  # |bias| at most (OpenAI's range, [-100, 100])
MAX_PENALTY = 2.0  # |presence| and |frequency| at most (OpenAI's range, [-2, 2])
MAX_END_IDS = 64  # end tokens (EOS and stop token ids) a request's min_tokens holds back
_NO_ID = np.iinfo(np.int32).max  # a padding entry's token id: past every vocabulary, dropped by the scatters


def check_controls(params: SamplingParams) -> None:
    """Raise ValueError, naming the command-line flag, for a control out of range."""
    for flag, value in (
        ("--presence-penalty", params.presence_penalty),
        ("--frequency-penalty", params.frequency_penalty),
    ):
        if not isinstance(value, numbers.Real) or not math.isfinite(value) or abs(value) > MAX_PENALTY:
            raise ValueError(f"{flag} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"--logit-bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(params.logit_bias)}")
    for token, bias in params.logit_bias:
        if not isinstance(token, numbers.Integral) or token < 0:
            raise ValueError(f"--logit-bias keys must be token ids (integers >= 0), got {token}")
        if not isinstance(bias, numbers.Real) or not math.isfinite(bias) or abs(bias) > MAX_BIAS:
            raise ValueError(f"--logit-bias values must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {bias} for {token}")
    if not isinstance(params.min_tokens, numbers.Integral) or params.min_tokens < 0:
        raise ValueError(f"--min-tokens must be an integer >= 0, got {params.min_tokens}")
    if len(params.end_ids) > MAX_END_IDS or any(not isinstance(t, numbers.Integral) or t < 0 for t in params.end_ids):
        raise ValueError(f"--stop-token-ids takes at most {MAX_END_IDS} token ids >= 0, got {list(params.end_ids)}")


def _padded(rows: Sequence[Sequence], width: int, fill, dtype) -> np.ndarray:
    table = np.full((len(rows), width), fill, dtype)
    for row, values in enumerate(rows):
        table[row, : len(values)] = values
    return table


@struct.dataclass
class LogitControls:
    """The logit controls of a batch, one row per request (a field of `SamplingArrays`)."""

    presence_B: jax.Array  # [B] float32
    frequency_B: jax.Array  # [B] float32
    bias_ids_BK: jax.Array  # [B, MAX_LOGIT_BIAS] int32: biased tokens, padded with _NO_ID
    bias_BK: jax.Array  # [B, MAX_LOGIT_BIAS] float32: their biases
    min_tokens_B: jax.Array  # [B] int32
    end_ids_BE: jax.Array  # [B, MAX_END_IDS] int32: the tokens held back before min_tokens, padded with _NO_ID

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], host: bool = False) -> LogitControls:
        """The batch's controls, on the device in one transfer (host: as numpy arrays)."""
        controls = cls(
            presence_B=np.array([p.presence_penalty for p in params], np.float32),
            frequency_B=np.array([p.frequency_penalty for p in params], np.float32),
            bias_ids_BK=_padded([[t for t, _ in p.logit_bias] for p in params], MAX_LOGIT_BIAS, _NO_ID, np.int32),
            bias_BK=_padded([[b for _, b in p.logit_bias] for p in params], MAX_LOGIT_BIAS, 0.0, np.float32),
            min_tokens_B=np.array([p.min_tokens for p in params], np.int32),
            end_ids_BE=_padded([p.end_ids if p.min_tokens else () for p in params], MAX_END_IDS, _NO_ID, np.int32),
        )
        return controls if host else jax.device_put(controls)


def count_tokens(counts_BV: jax.Array, tokens_B: jax.Array) -> jax.Array:
    """Each row's new token counted once more."""
    return counts_BV.at[jnp.arange(counts_BV.shape[0]), tokens_B].add(1)


def apply_penalties(logits_BV: jax.Array, counts_BV: jax.Array, presence_B: jax.Array, frequency_B: jax.Array):
    """OpenAI's presence and frequency penalties over the generated tokens' counts."""
    counts_BV = counts_BV.astype(jnp.float32)
    return logits_BV - presence_B[:, None] * (counts_BV > 0) - frequency_B[:, None] * counts_BV


def apply_logit_controls(
    logits_BV: jax.Array,
    controls: LogitControls,
    steps_B: jax.Array,
    counts_BV: jax.Array | None,
    features: SamplingFeatures = GENERAL,
) -> jax.Array:
    """The float32 logits with the rows' controls applied (steps 1-3 of the module doc). steps_B: [B] (or a
    scalar) tokens each row has generated; counts_BV: [B, V] int32 counts of those tokens (None: none yet);
    features: the controls the batch may use (the others left out at trace time)."""
    batch = logits_BV.shape[0]
    rows_B1 = jnp.arange(batch)[:, None]
    if counts_BV is not None:
        penalised = (controls.presence_B != 0) | (controls.frequency_B != 0)
        logits_BV = when_used(
            features.penalties,
            jnp.any(penalised),
            lambda: apply_penalties(logits_BV, counts_BV, controls.presence_B, controls.frequency_B),
            lambda: logits_BV,
        )
    logits_BV = when_used(
        features.logit_bias,
        jnp.any(controls.bias_ids_BK != _NO_ID),
        lambda: logits_BV.at[rows_B1, controls.bias_ids_BK].add(controls.bias_BK, mode="drop"),
        lambda: logits_BV,
    )
    holding_B = jnp.broadcast_to(steps_B, (batch,)) < controls.min_tokens_B
    held_ids_BE = jnp.where(holding_B[:, None], controls.end_ids_BE, _NO_ID)
    return when_used(
        features.min_tokens,
        jnp.any(held_ids_BE != _NO_ID),
        lambda: logits_BV.at[rows_B1, held_ids_BE].set(-jnp.inf, mode="drop"),
        lambda: logits_BV,
    )
