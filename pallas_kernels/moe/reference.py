"""Grouped matmul (the MoE expert GEMM) in pure jnp: the spec in code.

Rows of lhs are sorted by group: the first group_sizes[0] rows belong to group 0, the next group_sizes[1]
to group 1, and so on; each group multiplies its rows by its own weight in the checkpoint's [out, in]
layout, so out[rows of g] = lhs[rows of g] @ rhs[g].T. Rows at or past sum(group_sizes) give zeros.
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
