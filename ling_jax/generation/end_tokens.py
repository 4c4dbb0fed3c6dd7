"""Each row's end tokens on the device (EOS, stop token ids), for the programs of several decode steps or speculative
rounds that stop a row at its end: a [B, W] int32 bitmask per row in `grammar_mask`'s layout (token t is bit t % 32 of
word t // 32, W = ceil(V / 32)), so a row's end set has any size and changing it never recompiles.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.generation.grammar_mask import BITS, bitmask_words


def end_bitmask(rows: Sequence[Collection[int]], vocab_size: int) -> np.ndarray:
    """[B, W] int32: row b's bits set at its end tokens `rows[b]` (ids outside the vocabulary end nothing)."""
    bits_BW = np.zeros((len(rows), bitmask_words(vocab_size)), np.uint32)
    for row, ids in enumerate(rows):
        ids = np.array([t for t in ids if 0 <= t < vocab_size], np.int64)
        np.bitwise_or.at(bits_BW[row], ids // BITS, np.uint32(1) << (ids % BITS).astype(np.uint32))
    return bits_BW.view(np.int32)


def is_end(end_bits_BW: jax.Array, tokens_BT: jax.Array) -> jax.Array:
    """[B, T] bool: whether each row's tokens [B, T] are among its end tokens."""
    words_BT = jnp.take_along_axis(end_bits_BW, tokens_BT // BITS, axis=1)
    return ((words_BT >> (tokens_BT % BITS)) & 1).astype(bool)
