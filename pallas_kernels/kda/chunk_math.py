"""The per-chunk delta-rule update shared by the Pallas KDA prefill kernels (spec §2, chunked form).

A chunk is SUB = 16 tokens. `chunk_update` takes a chunk's decays and pair products and returns its output and
the next state; `chunk_step` forms them for gates >= GATE_FLOOR, `exact_decay.chunk_step_any_gate` for any gate.
With G the chunk-local cumulative log-decay (G_c = sum_{s<=c} g_s, so 0 >= G_0 >= ... >= G_15 >= -80 for gates
bounded by -5), every exponential `chunk_step` forms is of a difference against the chunk's first row:
e^{G - G_0} <= 1 and e^{G_0 - G} <= e^80 (fp32-safe), and their products are e^{G_c - G_j} <= 1 for j <= c. So
no sub-chunk bookkeeping is needed and all work is dots. The code uses only what both Pallas lowerings accept:
dots (with transposed operands), elementwise ops, iota masks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

SUB = 16
GATE_FLOOR = -5.0  # the lowest log-decay the bounded kernels (gpu_triton, tpu_mosaic) take


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


def chunk_update(q, k, v, decay, to_end, decay_last, a_qk, a_kk, beta, state, dots: Dots):
    """One SUB-token chunk from its decays and pair products, all fp32: q, k [C, K] (l2-normalised, q scaled);
    v [C, V]; decay = e^{G} and to_end = e^{G_last - G} [C, K] (G the chunk-local cumulative log-decay);
    decay_last [K, 1] = e^{G_last}; a_qk, a_kk [C, C] = sum_i x_c k_j e^{G_c - G_j} for x = q, k, at least on
    and below the diagonal (the rest is masked); beta [C, 1]; state [K, V]. Returns (o [C, V], new state [K, V])."""
    rows, cols = _iota(SUB, 0), _iota(SUB, 1)
    inverse = unit_lower_inverse(jnp.where(rows > cols, beta * a_kk, 0.0), dots)
    w = dots.nn(inverse, beta * k * decay)  # T (e^G k), T = (I + L)^-1 diag(beta)
    v_new = dots.nn(inverse, beta * v) - dots.nn(w, state)
    o = dots.nn(q * decay, state) + dots.nn(jnp.where(rows >= cols, a_qk, 0.0), v_new)
    state = decay_last * state + dots.tn(k * to_end, v_new)
    return o, state


def chunk_step(q, k, v, g_cum, g_first, g_last, decay_last, beta, state, dots: Dots):
    """`chunk_update` for gates >= -5: g_cum [C, K] the chunk-local cumulative log-decay, g_first, g_last [1, K]
    its first and last rows; the other arguments as there."""
    decay_from_first = jnp.exp(g_cum - g_first)  # e^{G_c - G_0} <= 1
    k_up = k * jnp.exp(g_first - g_cum)  # e^{G_0 - G_j} <= e^80
    a_kk = dots.nt(k * decay_from_first, k_up)  # [C, C]: sum_i k_c k_j e^{G_c - G_j}
    a_qk = dots.nt(q * decay_from_first, k_up)
    return chunk_update(q, k, v, jnp.exp(g_cum), jnp.exp(g_last - g_cum), decay_last, a_qk, a_kk, beta, state, dots)
