"""Order statistics of the rows of a [B, V] float32 array without sorting them: the k-th largest value, top-p's
cutoff, the k largest values with their indices.

Why not a sort: on a GPU, XLA turns the sort of a single row of the vocabulary into a CUB custom call, which an XLA
command buffer cannot hold; one inside a decode program's sampling `lax.cond` leaves the program's `while` loop to
the host, which then relaunches every step (450-620 us idle between steps of Ling-3.0-flash's first 24 layers on an
H100, 2026-12-05; docs/benchmarks/generation.md). Each statistic here is a search over float32's order-preserving
integer keys instead: DIGIT_BITS bits of the answer a pass, each pass one fused reduction over the row for
2**DIGIT_BITS - 1 candidate keys at once, the same ops on every backend. The results equal the sort-based ones
exactly for the statistics that are values of the row (the k-th largest, `top_k`'s values and indices, ties
taken lowest index first as `lax.top_k` takes them); top-p's cutoff sums the masses above each candidate in a
different order than a cumulative sum over the sorted row, so a row whose mass lands within float32 rounding of
top_p may keep one token more or fewer.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

DIGIT_BITS = 3  # bits of the key found a pass: 11 passes for 32 bits, 7 candidates each
_CANDIDATES = 2**DIGIT_BITS - 1
_SIGN = np.uint32(0x80000000)  # numpy: importing this module must not start a jax backend


def float_keys(x: jax.Array) -> jax.Array:
    """uint32 keys in the order of x's float32 values (-inf lowest, +inf highest; NaNs beyond both ends)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits & _SIGN, ~bits, bits | _SIGN)


def key_values(keys: jax.Array) -> jax.Array:
    """The float32 values of `float_keys`' keys; the NaN keys beyond -inf and +inf read as -inf and +inf."""
    lowest, highest = float_keys(jnp.float32(-jnp.inf)), float_keys(jnp.float32(jnp.inf))
    clamped = jnp.clip(keys, lowest, highest)
    bits = jnp.where(clamped & _SIGN, clamped & ~_SIGN, ~clamped)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def smallest_passing(predicate: Callable[[jax.Array], jax.Array], batch: int) -> jax.Array:
    """[B] float32: each row's smallest value v (over every float32, -inf to +inf) with predicate true, for a
    predicate monotone in v (false below some value, true from it on) and true at +inf. predicate: candidate
    values [B, C] -> bool [B, C]."""
    low_B = jnp.zeros((batch,), jnp.uint32)  # the largest key known to fail (0: none yet; its value is -inf)
    digits_C = jnp.arange(1, _CANDIDATES + 1, dtype=jnp.uint32)
    # the answer lies in (low, low + 2**(shift + DIGIT_BITS)]: each pass keeps the candidates that fail, a prefix
    for shift in [*range(32 - DIGIT_BITS, 0, -DIGIT_BITS), 0]:
        step = jnp.uint32(1 << shift)
        candidates_BC = low_B[:, None] + digits_C * step
        failing_B = jnp.sum(~predicate(key_values(candidates_BC)), axis=1, dtype=jnp.uint32)
        low_B = low_B + failing_B * step
    return key_values(low_B + 1)


def _row_value_from(x_BV: jax.Array, v_B: jax.Array) -> jax.Array:
    """[B]: each row's smallest value >= v_B (v_B found by a search may be a float between the row's values that
    compares like one of them: a subnormal where the backend flushes them to zero)."""
    return jnp.min(jnp.where(x_BV >= v_B[:, None], x_BV, jnp.inf), axis=1)


def kth_largest(x_BV: jax.Array, k_B: jax.Array) -> jax.Array:
    """[B]: each row's k-th largest value (1 <= k_B <= V): the smallest v with fewer than k values above it."""
    x_BV = x_BV.astype(jnp.float32)
    above_k = lambda v_BC: jnp.sum(x_BV[:, None, :] > v_BC[:, :, None], axis=2) < k_B[:, None]  # noqa: E731
    return _row_value_from(x_BV, smallest_passing(above_k, len(x_BV)))


def top_p_cutoff(x_BV: jax.Array, floor_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """[B]: the smallest value top-p keeps among a row's values >= floor_B (top-k's k-th largest, or the row's
    smallest): the smallest v >= floor whose softmax mass strictly above it (over the values >= floor) is below
    top_p; with top_p >= 1, the floor itself. Keeping the values >= it keeps the smallest prefix of the sorted
    row whose mass reaches top_p, and every value tied with its last."""
    x_BV = x_BV.astype(jnp.float32)
    floor_B1 = floor_B[:, None]
    weights_BV = jnp.where(x_BV >= floor_B1, jnp.exp(x_BV - jnp.max(x_BV, axis=1, keepdims=True)), 0.0)
    budget_B1 = (top_p_B * jnp.sum(weights_BV, axis=1))[:, None]

    def keeps(v_BC):
        above_BC = jnp.sum(jnp.where(x_BV[:, None, :] > v_BC[:, :, None], weights_BV[:, None, :], 0.0), axis=2)
        return (v_BC >= floor_B1) & ((above_BC < budget_B1) | (top_p_B[:, None] >= 1))

    return _row_value_from(x_BV, smallest_passing(keeps, len(x_BV)))


def top_k(x_BV: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(values [B, k], int32 indices [B, k]): each row's k largest values, largest first, equal values lowest
    index first (`jax.lax.top_k`'s result), for 1 <= k <= V."""
    batch, vocab = x_BV.shape
    kth_B1 = kth_largest(x_BV, jnp.full((batch,), k, jnp.int32))[:, None]
    above_BV, tied_BV = x_BV > kth_B1, x_BV == kth_B1
    room_B1 = k - jnp.sum(above_BV, axis=1, keepdims=True)  # the ties taken, lowest index first
    chosen_BV = above_BV | (tied_BV & (jnp.cumsum(tied_BV, axis=1) <= room_B1))
    slots_BV = jnp.where(chosen_BV, jnp.cumsum(chosen_BV, axis=1) - 1, k)  # k: dropped
    rows_BV = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, vocab))
    indices_BK = (
        jnp.zeros((batch, k), jnp.int32)
        .at[rows_BV, slots_BV]
        .set(jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), (batch, vocab)), mode="drop")
    )
    values_BK = jnp.take_along_axis(x_BV, indices_BK, axis=1)
    _, indices_BK, values_BK = jax.lax.sort((-values_BK, indices_BK, values_BK), dimension=1, num_keys=2)
    return values_BK, indices_BK
