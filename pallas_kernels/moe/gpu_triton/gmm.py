"""Grouped matmul on GPU: a Pallas kernel (Triton lowering) over row tiles that never cross a group.

`grouped_matmul_gpu` is the plain body over the grouped skeleton (`grouped`: the row tiles, the K loop, the
store): program (column tile, row tile) runs the K loop of its rows against its group's weight and stores them.
The dots spent on partial tiles are what padding each group to block_m would cost. With rhs read as [G, K, N] it
gives d_lhs = d_out @ rhs[g]; `grouped_weight_grad_gpu` gives d_rhs[g] = d_out[rows of g].T @ lhs[rows of g], one
program per (K tile, N tile, group) walking the group's rows, so training needs no ragged_dot (whose XLA GPU
lowering materialises a masked lhs per group).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.moe import tuned
from pallas_kernels.moe.gpu_triton.grouped import Tile, TileShape, grouped_call, launch_settings
from pallas_kernels.triton_masked import mask_2d, masked_load


def _kernel(tile: Tile, lhs_ref, rhs_ref, out_ref, *, rhs_transposed: bool):
    (acc_MN,) = tile.weight_products(functools.partial(tile.rows, lhs_ref), (rhs_ref,), rhs_transposed=rhs_transposed)
    tile.store(out_ref, acc_MN)


def _weight_grad_kernel(offsets_ref, lhs_ref, d_out_ref, d_rhs_ref, *, shape: TileShape):
    block_m, block_n, block_k = shape.block_m, shape.block_n, shape.block_k
    k0, col0, group = pl.program_id(0) * block_k, pl.program_id(1) * block_n, pl.program_id(2)
    start, end = offsets_ref[group], offsets_ref[group + 1]
    k_ok_K = k0 + jnp.arange(block_k) < shape.k_dim if shape.mask_k else None
    cols_ok_N = col0 + jnp.arange(block_n) < shape.n_dim if shape.mask_n else None

    def row_body(step, acc_NK):
        row0 = start + step * block_m
        rows_ok_M = row0 + jnp.arange(block_m) < end
        d_out_MN = masked_load(d_out_ref.at[pl.ds(row0, block_m), pl.ds(col0, block_n)], mask_2d(rows_ok_M, cols_ok_N))
        lhs_MK = masked_load(lhs_ref.at[pl.ds(row0, block_m), pl.ds(k0, block_k)], mask_2d(rows_ok_M, k_ok_K))
        return acc_NK + plgpu.dot(d_out_MN, lhs_MK, trans_a=True, allow_tf32=lhs_ref.dtype != jnp.float32)

    acc_NK = jax.lax.fori_loop(0, pl.cdiv(end - start, block_m), row_body, jnp.zeros((block_n, block_k), jnp.float32))
    plgpu.store(
        d_rhs_ref.at[group, pl.ds(col0, block_n), pl.ds(k0, block_k)],
        acc_NK.astype(d_rhs_ref.dtype),
        mask=mask_2d(cols_ok_N, k_ok_K),
    )


_LAUNCH_ARGS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=("rhs_transposed", "min_block_m", *_LAUNCH_ARGS))
def grouped_matmul_gpu(
    lhs_MK,
    rhs,
    group_sizes_G,
    *,
    rhs_transposed: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_block_m: int | None = None,
    interpret: bool = False,
):
    """out [M, N] in lhs's dtype (fp32 accumulation): out[rows of g] = lhs[rows of g] @ rhs[g].T for rhs
    [G, N, K], or lhs[rows of g] @ rhs[g] for rhs [G, K, N] with rhs_transposed (the gradient w.r.t. lhs).

    rhs is cast to lhs's dtype; bf16 products use the tensor cores, fp32 ones stay IEEE fp32 (no tf32).
    Tile sizes and launch settings: None from `tuned.GROUPED_MATMUL` for lhs's dtype and the rows' bucket; tiles
    are powers of two. A group's last, partial row tile runs at the smallest power of two >= min_block_m (default
    `grouped.MIN_ROW_TILE`) that holds its rows.
    """
    num_rows, k_dim = lhs_MK.shape
    n_dim = rhs.shape[2] if rhs_transposed else rhs.shape[1]
    tiles = launch_settings(
        tuned.GROUPED_MATMUL,
        (block_m, block_n, block_k, num_warps, num_stages),
        dtype=lhs_MK.dtype,
        num_rows=num_rows,
        num_groups=group_sizes_G.shape[0],
        n_dim=n_dim,
        k_dim=k_dim,
    )
    return grouped_call(
        functools.partial(_kernel, rhs_transposed=rhs_transposed),
        group_sizes_G,
        (lhs_MK, rhs.astype(lhs_MK.dtype)),
        jax.ShapeDtypeStruct((num_rows, n_dim), lhs_MK.dtype),
        tiles,
        k_dim=k_dim,
        interpret=interpret,
        name="grouped_matmul",
        min_block_m=min_block_m,
    )


@functools.partial(jax.jit, static_argnames=_LAUNCH_ARGS)
def grouped_weight_grad_gpu(
    lhs_MK,
    d_out_MN,
    group_sizes_G,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
):
    """d_rhs [G, N, K] in lhs's dtype (fp32 accumulation): d_rhs[g] = d_out[rows of g].T @ lhs[rows of g].

    An empty group gets zeros. d_out is cast to lhs's dtype; tiles: None from `tuned.WEIGHT_GRAD`.
    """
    num_rows, k_dim = lhs_MK.shape
    n_dim = d_out_MN.shape[1]
    num_groups = group_sizes_G.shape[0]
    if num_rows == 0:
        return jnp.zeros((num_groups, n_dim, k_dim), lhs_MK.dtype)
    tiles = launch_settings(
        tuned.WEIGHT_GRAD,
        (block_m, block_n, block_k, num_warps, num_stages),
        dtype=lhs_MK.dtype,
        num_rows=num_rows,
        num_groups=num_groups,
        n_dim=n_dim,
        k_dim=k_dim,
    )
    offsets = jnp.concatenate(
        [jnp.zeros((1,), jnp.int32), jnp.minimum(jnp.cumsum(group_sizes_G.astype(jnp.int32)), num_rows)]
    )
    shape = TileShape(tiles.block_m, tiles.block_n, tiles.block_k, n_dim, k_dim, num_groups)
    whole = lambda dims: pl.BlockSpec(dims, lambda k, n, g: (0,) * len(dims))  # noqa: E731
    return pl.pallas_call(
        functools.partial(_weight_grad_kernel, shape=shape),
        grid=(pl.cdiv(k_dim, shape.block_k), pl.cdiv(n_dim, shape.block_n), num_groups),
        in_specs=[whole((num_groups + 1,)), whole(lhs_MK.shape), whole(d_out_MN.shape)],
        out_specs=whole((num_groups, n_dim, k_dim)),
        out_shape=jax.ShapeDtypeStruct((num_groups, n_dim, k_dim), lhs_MK.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="grouped_weight_grad",
    )(offsets, lhs_MK, d_out_MN.astype(lhs_MK.dtype))
