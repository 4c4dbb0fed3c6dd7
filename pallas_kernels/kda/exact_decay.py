"""Decay products inside a SUB-row block for log-decays of any size, shared by the Pallas KDA prefill kernels'
any-gate variants (`gpu_triton_any_gate`, `tpu_mosaic_any_gate`).

The bounded kernels split a pair decay e^{G_c - G_s} (G the cumulative log-decay inside the block) into a factor
per row, e^{G_c + S} e^{-G_s - S}, which stays inside fp32 only while 16 gates sum to no less than about -80
(gates >= -5). Here nothing of the kind is formed:
- a pair decay is the running product prod_{s<t<=c} e^{g_t} of per-step decays (each <= 1), built column by
  column from the block's last row (`pair_products`): no factor exceeds 1, so there is nothing to overflow, and
  an underflow to 0 stands for a product that is 0 to fp32 anyway;
- a decay to the block's end or from its start is the exponential of a sum of exactly the gates it spans
  (`suffix_sums`, `prefix_sums`: products with a triangular 0/1 matrix), never the difference of two cumulative
  sums, whose rounding (~ulp of the larger sum, 1e-4 at sums near -1000) would enter the exponent.
`chunk_step_any_gate` is `chunk_math.chunk_step` built from these (the TPU kernel's chunk is one such block).
Only what both Pallas lowerings accept: elementwise ops, iota masks, sums along one axis and dots.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.kda.chunk_math import SUB, Dots, chunk_update


def _iota(shape, axis: int):
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def suffix_sums(x_SW, dot: Callable):
    """[SUB, W]: sum_{t>c} x_t at row c (0 at the last row). dot: an fp32 product exact for 0/1 left operands."""
    later = (_iota((SUB, SUB), 1) > _iota((SUB, SUB), 0)).astype(jnp.float32)
    return dot(later, x_SW)


def prefix_sums(x_SW, dot: Callable):
    """[SUB, W]: sum_{t<=c} x_t at row c. dot as for `suffix_sums`."""
    through = (_iota((SUB, SUB), 1) <= _iota((SUB, SUB), 0)).astype(jnp.float32)
    return dot(through, x_SW)


def _row(x_SW, s):
    """Row s (a Python or traced int) of x as [1, W]: a masked sum, no dynamic slice of a register value."""
    return jnp.sum(jnp.where(_iota(x_SW.shape, 0) == s, x_SW, 0.0), axis=0, keepdims=True)


def pair_products(lefts, keys_SW, step_decay_SW):
    """For each x of lefts ([SUB, W] each): [SUB, SUB] with sum_i x_c[i] k_s[i] e^{G_c[i] - G_s[i]} at (c, s <= c)
    and 0 above the diagonal; keys_SW the block's keys k_s, step_decay_SW = e^{g} (<= 1). W may be a column block
    of the keys: the products over all of them are the sums of the blocks'.

    A loop over the columns from the last, s = SUB-1 down to 0, carrying decay_SW = e^{G_c - G_s} at rows c >= s
    (0 above): row s is 1, and each row below it is the same row of column s + 1's decay times e^{g_{s+1}} (at
    s = SUB-1 the row of e^g past the end is 0, and so was every row of the decay)."""
    rows = _iota(keys_SW.shape, 0)
    cols = _iota((SUB, SUB), 1)

    def column(m, carry):
        s = SUB - 1 - m
        decay_SW, products = carry
        decay_SW = jnp.where(rows == s, 1.0, decay_SW * _row(step_decay_SW, s + 1))
        decayed_key_SW = _row(keys_SW, s) * decay_SW  # k_s[i] e^{G_c[i] - G_s[i]} at row c
        return decay_SW, tuple(
            jnp.where(cols == s, jnp.sum(x_SW * decayed_key_SW, axis=1, keepdims=True), product)
            for x_SW, product in zip(lefts, products)
        )

    zeros_SS = jnp.zeros((SUB, SUB), jnp.float32)
    start = (jnp.zeros(keys_SW.shape, jnp.float32), tuple(zeros_SS for _ in lefts))
    return list(jax.lax.fori_loop(0, SUB, column, start)[1])


def chunk_step_any_gate(q, k, v, g, decay_last, beta, state, dots: Dots):
    """`chunk_math.chunk_update` of one SUB-token chunk for gates of any size: g [C, K] its log-decays (<= 0) as
    given; decay_last [K, 1] = e^{G_last}; the other arguments as there. dots: products at full fp32 precision
    (the sums of g go through dots.nn)."""
    a_qk, a_kk = pair_products([q, k], k, jnp.exp(g))
    decay, to_end = jnp.exp(prefix_sums(g, dots.nn)), jnp.exp(suffix_sums(g, dots.nn))
    return chunk_update(q, k, v, decay, to_end, decay_last, a_qk, a_kk, beta, state, dots)
