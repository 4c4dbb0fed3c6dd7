"""Grammar-constrained sampling on the device: each row's token bitmask applied to its logits.

A row's bitmask is [W] int32, W = ceil(V / 32): token t is allowed where bit t % 32 of word t // 32 is set (the
layout llguidance and xgrammar fill on the host); bits past V are ignored. A row without a grammar has every bit
set (-1 words). `mask_logits` sets the disallowed tokens' logits to -inf, before the sampler's penalty,
temperature and filters (so greedy rows too take the best allowed token), and is skipped with a `lax.cond` when
no row of the batch has a cleared bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.generation.sampling_features import when_used

BITS = 32  # tokens per bitmask word
ALL_ALLOWED = -1  # a word with every bit set


def bitmask_words(vocab_size: int) -> int:
    """W: the int32 words of one row's bitmask."""
    return -(-vocab_size // BITS)


def unconstrained(batch: int, vocab_size: int) -> np.ndarray:
    """[B, W] int32 bitmasks that allow every token."""
    return np.full((batch, bitmask_words(vocab_size)), ALL_ALLOWED, np.int32)


def allowed_tokens(bitmask_BW: jax.Array, vocab_size: int) -> jax.Array:
    """[B, V] bool: the tokens each row's bitmask allows."""
    bits_BWK = (bitmask_BW[:, :, None] >> jnp.arange(BITS, dtype=jnp.int32)) & 1
    return bits_BWK.reshape(bitmask_BW.shape[0], -1)[:, :vocab_size].astype(bool)


def mask_logits(logits_BV: jax.Array, bitmask_BW: jax.Array | None, used: bool = True) -> jax.Array:
    """`logits_BV` with -inf where a row's bitmask clears the token; unchanged without bitmasks (None or `used`
    False: no row has a grammar) and, through a `lax.cond`, when every bit of the batch is set."""
    if bitmask_BW is None:
        return logits_BV
    return when_used(
        used,
        jnp.any(bitmask_BW != ALL_ALLOWED),
        lambda: jnp.where(allowed_tokens(bitmask_BW, logits_BV.shape[-1]), logits_BV, -jnp.inf).astype(logits_BV.dtype),
        lambda: logits_BV,
    )
