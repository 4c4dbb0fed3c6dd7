"""The fused routed-expert ops in pure jnp, the spec in code: `gather_swiglu` (gate/up grouped matmuls over rows
gathered from the unsorted activations, then SwiGLU) and `down_scatter` (down grouped matmul, weighted per
row, stored back to each row's original place). Rows are sorted by group as for `grouped_matmul_reference`."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.moe.reference import grouped_matmul_reference, swiglu


def gather_swiglu_reference(x_XD, source_R, group_sizes_G, gate_GID, up_GID, limit: float | None):
    """h [R, I] in x's dtype: swiglu(x[source[r]] @ gate[g].T, x[source[r]] @ up[g].T, limit) for the rows r
    of group g; rows at or past sum(group_sizes) give zeros."""
    x_RD = x_XD[source_R]
    return swiglu(grouped_matmul_reference(x_RD, gate_GID, group_sizes_G),
                  grouped_matmul_reference(x_RD, up_GID, group_sizes_G), limit)


def down_scatter_reference(h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI):
    """y [R, D] in h's dtype: y[dest[r]] = row_weight[r] * (h[r] @ down[g].T) for the rows r of group g, the
    weighting in fp32; rows at or past sum(group_sizes) give zeros. dest is a permutation of [0, R)."""
    y_RD = grouped_matmul_reference(h_RI, down_GDI, group_sizes_G)
    weighted_RD = (row_weight_R.astype(jnp.float32)[:, None] * y_RD.astype(jnp.float32)).astype(h_RI.dtype)
    return jnp.zeros_like(weighted_RD).at[dest_R].set(weighted_RD)
