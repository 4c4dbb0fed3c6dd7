"""The per-chunk delta-rule update shared by the Pallas KDA prefill kernels (spec §2, chunked form).

A chunk is SUB = 16 tokens. With G the chunk-local cumulative log-decay (G_c = sum_{s<=c} g_s, so
0 >= G_0 >= ... >= G_15 >= -80 for gates bounded by -5), every exponential formed is of a difference
against the chunk's first row: e^{G - G_0} <= 1 and e^{G_0 - G} <= e^80 (fp32-safe), and their products
are e^{G_c - G_j} <= 1 for j <= c. So no sub-chunk bookkeeping is needed and all work is dots. The code
uses only what both Pallas lowerings accept: dots (with transposed operands), elementwise ops, iota masks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

SUB = 16


@dataclasses.dataclass(frozen=True)
class Dots:
    """fp32 matrix products for a backend: a @ b, a @ b.T, a.T @ b."""

    nn: Callable
    nt: Callable
    tn: Callable


def _iota(n: int, axis: int):
    return jax.lax.broadcasted_iota(jnp.int32, (n, n), axis)


def unit_lower_inverse(strict_L, dots: Dots):
    """(I + L)^-1 for a strictly lower-triangular L [SUB, SUB], by forward substitution one row at a time."""
    rows, cols = _iota(SUB, 0), _iota(SUB, 1)
    inverse = (rows == cols).astype(jnp.float32)
    for c in range(1, SUB):
        update = dots.nn(jnp.where(rows == c, strict_L, 0.0), inverse)  # only row c: sum_j L[c, j] inverse[j]
        inverse = jnp.where(rows == c, inverse - update, inverse)
    return inverse


def chunk_step(q, k, v, g_cum, g_first, g_last, decay_last, beta, state, dots: Dots):
    """One SUB-token chunk, all fp32: q, k [C, K] (l2-normalised, q scaled); v [C, V]; g_cum [C, K] chunk-local
    cumulative log-decay; g_first, g_last [1, K] = its first and last rows; decay_last [K, 1] = e^{g_last};
    beta [C, 1]; state [K, V]. Returns (o [C, V], new state [K, V])."""
    rows, cols = _iota(SUB, 0), _iota(SUB, 1)
    decay_from_first = jnp.exp(g_cum - g_first)  # e^{G_c - G_0} <= 1
    k_up = k * jnp.exp(g_first - g_cum)  # e^{G_0 - G_j} <= e^80
    a_kk = dots.nt(k * decay_from_first, k_up)  # [C, C]: sum_i k_c k_j e^{G_c - G_j}
    a_qk = dots.nt(q * decay_from_first, k_up)
    inverse = unit_lower_inverse(jnp.where(rows > cols, beta * a_kk, 0.0), dots)
    decay = jnp.exp(g_cum)  # e^{G_c} <= 1: decay since the chunk's start
    w = dots.nn(inverse, beta * k * decay)  # T (e^G k), T = (I + L)^-1 diag(beta)
    v_new = dots.nn(inverse, beta * v) - dots.nn(w, state)
    o = dots.nn(q * decay, state) + dots.nn(jnp.where(rows >= cols, a_qk, 0.0), v_new)
    state = decay_last * state + dots.tn(k * jnp.exp(g_last - g_cum), v_new)
    return o, state
