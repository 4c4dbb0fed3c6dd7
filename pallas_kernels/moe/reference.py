"""The MoE expert kernels in pure jnp, the spec in code: the grouped matmul (the expert GEMM over rows
sorted by expert) and the routed experts of a few tokens (each token's picked experts, combined).

Grouped matmul: rows of lhs are sorted by group: the first group_sizes[0] rows belong to group 0, the next
group_sizes[1] to group 1, and so on; each group multiplies its rows by its own weight in the checkpoint's
[out, in] layout, so out[rows of g] = lhs[rows of g] @ rhs[g].T. Rows at or past sum(group_sizes) give zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# lhs [M, K] x rhs [G, N, K] -> [M, N]: contract K with K, M is ragged over rhs's group dimension.
_RAGGED_MK_GNK = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def grouped_matmul_reference(lhs_MK, rhs_GNK, group_sizes_G) -> jax.Array:
    """out [M, N] in lhs's dtype, accumulated in fp32; differentiable in lhs and rhs.

    group_sizes int [G], traced, with sum <= M. The tail rows are zeroed explicitly: ragged_dot leaves
    them unspecified in its documentation. fp32 products are full fp32 (XLA would use tf32 on a GPU).
    On a GPU, XLA (jax 0.11.2) lowers ragged_dot through a masked copy of lhs per group, [G, M, K]: fine
    for tests, out of memory at MoE sizes (use the "pallas_gpu" backend there).
    """
    precision = jax.lax.Precision.HIGHEST if lhs_MK.dtype == jnp.float32 else None
    out_MN = jax.lax.ragged_dot_general(lhs_MK, rhs_GNK.astype(lhs_MK.dtype), group_sizes_G.astype(jnp.int32),
                                        _RAGGED_MK_GNK, precision=precision, preferred_element_type=jnp.float32)
    used_M = jnp.arange(lhs_MK.shape[0]) < jnp.sum(group_sizes_G)
    return jnp.where(used_M[:, None], out_MN, 0.0).astype(lhs_MK.dtype)


def swiglu(gate: jax.Array, up: jax.Array, limit: float | None) -> jax.Array:
    """SiLU(gate) * up, or min(SiLU(gate), limit) * clip(up, -limit, limit) when the layer has a limit."""
    activated = jax.nn.silu(gate)
    if limit is None:
        return activated * up
    return jnp.minimum(activated, limit) * jnp.clip(up, -limit, limit)


def routed_experts_reference(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, limit: float | None,
                             shared=None, shared_limit: float | None = None):
    """sum_k weights[t, k] * FFN_{experts[t, k]}(x[t]) -> [T, D] in x's dtype, where FFN_e is expert e's SwiGLU
    (clipped at `limit`), computed in fp32 from the gathered experts' weights [T, K, ...]; experts outside
    [0, E) contribute nothing. shared: None, or the shared expert's (gate [I, D], up [I, D], down [D, I]),
    clipped at `shared_limit` and added (in fp32, before the cast)."""
    num_experts = gate_EID.shape[0]
    valid_TK = (experts_TK >= 0) & (experts_TK < num_experts)
    index_TK = jnp.clip(experts_TK, 0, num_experts - 1)
    x = x_TD.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    gate = jnp.einsum("td,tkid->tki", x, gate_EID[index_TK].astype(jnp.float32), precision=hi)
    up = jnp.einsum("td,tkid->tki", x, up_EID[index_TK].astype(jnp.float32), precision=hi)
    y_TKD = jnp.einsum("tki,tkdi->tkd", swiglu(gate, up, limit), down_EDI[index_TK].astype(jnp.float32), precision=hi)
    weights_TK = jnp.where(valid_TK, weights_TK.astype(jnp.float32), 0.0)
    y_TD = jnp.einsum("tkd,tk->td", y_TKD, weights_TK, precision=hi)
    if shared is not None:
        shared_gate_ID, shared_up_ID, shared_down_DI = (w.astype(jnp.float32) for w in shared)
        hidden_TI = swiglu(jnp.dot(x, shared_gate_ID.T, precision=hi), jnp.dot(x, shared_up_ID.T, precision=hi),
                           shared_limit)
        y_TD = y_TD + jnp.dot(hidden_TI, shared_down_DI.T, precision=hi)
    return y_TD.astype(x_TD.dtype)
