"""The routed experts of a few tokens (decode) from block-FP8 experts written for XLA, not Pallas: each
token-expert row's projection is an elementwise product and a sum over the inputs, the picked expert's e4m3
values gathered and converted inside that reduction (XLA fuses gather, convert, product and sum), so the bytes
read are the picked experts' as stored. The weight scales are folded into the row's input, as in
`fp8.xla_folded`: for the outputs of row block b of expert e, x_s[r, b, i] = x[r, i] * scales[e, b, i // bc].

A lab variant, for `benchmarks/moe/quantized.py`: on the H200 it did not beat the row kernels (docs/benchmarks/
moe.md), so no path of `pallas_kernels.moe.ops` runs it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.moe.reference import swiglu


def takes(weights) -> bool:
    """Whether `routed_experts_xla` runs these experts: block-FP8 stacks [E, N, K] whose N and K are multiples of
    the block."""
    return all(
        getattr(w, "block", None) is not None
        and w.values.ndim == 3
        and w.values.shape[1] % w.block[0] == 0
        and w.values.shape[2] % w.block[1] == 0
        for w in weights
    )


def _rows_product(x_RK, weight, experts_R):
    """[R, N] fp32: row r's x times expert experts[r]'s block-FP8 weight [N, K], transposed."""
    block_rows, block_cols = weight.block
    _, n_dim, k_dim = weight.values.shape
    scales_RBK = jnp.repeat(weight.scales[experts_R].astype(jnp.float32), block_cols, axis=-1)
    x_RBK = x_RK.astype(jnp.float32)[:, None, :] * scales_RBK
    values_RBCK = weight.values[experts_R].reshape(-1, n_dim // block_rows, block_rows, k_dim)
    return jnp.sum(x_RBK[:, :, None, :] * values_RBCK.astype(jnp.float32), axis=-1).reshape(-1, n_dim)


@functools.partial(jax.jit, static_argnames=("limit",))
def routed_experts_xla(x_TD, weights_TK, experts_TK, gate, up, down, limit: float | None) -> jax.Array:
    """sum_k weights[t, k] * FFN_{experts[t, k]}(x[t]) -> [T, D] in x's dtype, as `routed_experts` (fp32
    products and sums), for block-FP8 gate, up [E, I, D] and down [E, D, I] (`takes`)."""
    if not takes((gate, up, down)):
        raise ValueError(
            "routed_experts_xla: gate, up and down must be block-FP8 stacks [E, N, K] with N and K multiples of the "
            f"block, got {[(list(w.values.shape), getattr(w, 'block', None)) for w in (gate, up, down)]}"
        )
    tokens, top_k = experts_TK.shape
    experts_R = experts_TK.reshape(-1)
    x_RD = jnp.repeat(x_TD, top_k, axis=0)
    h_RI = swiglu(_rows_product(x_RD, gate, experts_R), _rows_product(x_RD, up, experts_R), limit)
    y_RD = _rows_product(h_RI, down, experts_R) * weights_TK.reshape(-1, 1).astype(jnp.float32)
    return jnp.sum(y_RD.reshape(tokens, top_k, -1), axis=1).astype(x_TD.dtype)
