"""The block-scaled matmul both FP8 linear kernels run: y = sum over K blocks of (lhs block @ weight block^T) *
its scales, one Pallas program (Triton lowering) per [block_m, block_n] output tile.

The K step is the weight's scale block (block_k inputs), and block_n divides the weight's row block, so each
step's partial product takes one weight scale (a scalar load). Weight-only: lhs is x itself and the e4m3 tile is
cast to x's dtype before the dot (exact: e4m3 values fit bf16, fp16 and fp32), so the weight is read as 1 byte an
element. W8A8: lhs is x quantised to e4m3 (`reference.quantize_activations`), the dot is FP8 x FP8, and the
partial product is also scaled per row by the activation scales of that K block; with `tc_accumulated` the FP8
dot is `fp8_dot.fp8_dot` (the K block's products accumulated in the tensor cores, not split per wgmma by Triton).
Either way the accumulator is fp32 and edge tiles (M, N, K not multiples of the tile) are masked. Weight-only
products may put the weight tile on the dot's left (`weight_left`: [block_n, block_m] accumulators, transposed
before the store), so that Hopper's wgmma takes the converted tile from registers.

Programs are laid out along the first grid axis in groups of group_m row tiles: the programs of a group walk the
same column tiles together, so a weight tile is read from HBM about once per group. The second grid axis cuts the
K steps into k_splits ranges (decode: a few rows give few output tiles); each range stores its fp32 partial sums,
added after the kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.fp8.gpu_triton.fp8_dot import scaled_fp8_product
from pallas_kernels.fp8.tuned import LinearTiles
from pallas_kernels.triton_masked import mask_2d, masked_load


def _tile_origin(num_row_tiles: int, num_col_tiles: int, group_m: int):
    """(row tile, column tile) of this program: groups of group_m row tiles, column tiles in order within a group
    and the row tiles of a group varying fastest."""
    program = pl.program_id(0)
    per_group = group_m * num_col_tiles
    first_row_tile = program // per_group * group_m
    rows_in_group = jnp.minimum(num_row_tiles - first_row_tile, group_m)
    within = program % per_group
    return first_row_tile + within % rows_in_group, within // rows_in_group


def _kernel(
    lhs_ref,
    values_ref,
    scales_ref,
    *refs,
    tiles: LinearTiles,
    block_k: int,
    block_rows: int,
    masks,
    tc_accumulated: bool,
    weight_left: bool,
):
    """refs: (row_scales_ref, y_ref) for W8A8 (row scales [M, K blocks]), (y_ref,) for weight-only."""
    *row_scales_ref, y_ref = refs
    (num_rows, k_dim), n_dim = lhs_ref.shape, values_ref.shape[0]
    block_m, block_n = tiles.block_m, tiles.block_n
    mask_m, mask_n, mask_k = masks
    row_tile, col_tile = _tile_origin(pl.cdiv(num_rows, block_m), pl.cdiv(n_dim, block_n), tiles.group_m)
    row0, col0 = row_tile * block_m, col_tile * block_n
    rows_ok_M = row0 + jnp.arange(block_m) < num_rows if mask_m else None
    cols_ok_N = col0 + jnp.arange(block_n) < n_dim if mask_n else None
    scale_row = col0 // block_rows
    compute_dtype = lhs_ref.dtype
    num_steps = pl.cdiv(k_dim, block_k)
    steps_per_split = pl.cdiv(num_steps, tiles.k_splits)
    first_step = pl.program_id(1) * steps_per_split
    last_step = jnp.minimum(first_step + steps_per_split, num_steps)

    def k_step(step, acc):
        """acc: [block_m, block_n], or [block_n, block_m] with weight_left."""
        k0 = step * block_k
        k_ok_K = k0 + jnp.arange(block_k) < k_dim if mask_k else None
        lhs_MK = masked_load(lhs_ref.at[pl.ds(row0, block_m), pl.ds(k0, block_k)], mask_2d(rows_ok_M, k_ok_K))
        w_NK = masked_load(values_ref.at[pl.ds(col0, block_n), pl.ds(k0, block_k)], mask_2d(cols_ok_N, k_ok_K))
        scale = scales_ref[scale_row, step]
        if row_scales_ref:
            row_scale_M = masked_load(row_scales_ref[0].at[pl.ds(row0, block_m), step], rows_ok_M)
            if tc_accumulated:
                return acc + scaled_fp8_product(lhs_MK, w_NK, row_scale_M, scale)
        allow_tf32 = compute_dtype != jnp.float32
        if weight_left:
            return acc + plgpu.dot(w_NK.astype(compute_dtype), lhs_MK, trans_b=True, allow_tf32=allow_tf32) * scale
        partial_MN = plgpu.dot(lhs_MK, w_NK.astype(compute_dtype), trans_b=True, allow_tf32=allow_tf32)
        if row_scales_ref:
            return acc + partial_MN * (row_scale_M[:, None] * scale)
        return acc + partial_MN * scale

    acc_shape = (block_n, block_m) if weight_left else (block_m, block_n)
    acc = jax.lax.fori_loop(first_step, last_step, k_step, jnp.zeros(acc_shape, jnp.float32))
    acc_MN = acc.T if weight_left else acc
    split = (pl.program_id(1),) if tiles.k_splits > 1 else ()
    plgpu.store(
        y_ref.at[(*split, pl.ds(row0, block_m), pl.ds(col0, block_n))],
        acc_MN.astype(y_ref.dtype),
        mask=mask_2d(rows_ok_M, cols_ok_N),
    )


def _tile(size: int, wanted: int, at_most: int | None = None) -> int:
    """A power of two: `wanted`, cut to the problem and to at_most, at least 16 (Triton's dots)."""
    return max(16, min(wanted, pl.next_power_of_2(size), at_most or wanted))


def fit_tiles(tiles: LinearTiles, *, num_rows: int, n_dim: int, block_rows: int, num_k_steps: int) -> LinearTiles:
    """The tiles cut to the problem: block_m to the rows, block_n to the outputs and the weight's row block,
    k_splits to the K steps."""
    return dataclasses.replace(
        tiles,
        block_m=_tile(num_rows, tiles.block_m),
        block_n=_tile(n_dim, tiles.block_n, block_rows),
        k_splits=max(1, min(tiles.k_splits, num_k_steps)),
    )


def block_scaled_matmul(
    lhs_MK,
    values_NK,
    scales,
    row_scales,
    *,
    block: tuple[int, int],
    tiles: LinearTiles,
    out_dtype,
    interpret: bool,
    tc_accumulated: bool = False,
    weight_left: bool = False,
) -> jax.Array:
    """y [M, N] of out_dtype (module docstring). lhs [M, K] (x, or x_q e4m3 with row_scales [M, ceil(K /
    block[1])]); row_scales None for weight-only. values [N, K] e4m3, scales [ceil(N / block[0]), ceil(K /
    block[1])]; block (rows, cols) powers of two, cols >= 16 (Triton's dots); tiles already fitted
    (`fit_tiles`). tc_accumulated (W8A8 only): the FP8 dots through `fp8_dot`. weight_left (weight-only only):
    `tuned.WeightOnlyTiles.weight_left`."""
    if weight_left and row_scales is not None:
        raise ValueError("block_scaled_matmul: weight_left is for the weight-only product (row_scales None)")
    num_rows, k_dim = lhs_MK.shape
    n_dim = values_NK.shape[0]
    block_rows, block_k = block
    kernel = functools.partial(
        _kernel,
        tiles=tiles,
        block_k=block_k,
        block_rows=block_rows,
        masks=(num_rows % tiles.block_m != 0, n_dim % tiles.block_n != 0, k_dim % block_k != 0),
        tc_accumulated=tc_accumulated,
        weight_left=weight_left,
    )
    operands = (lhs_MK, values_NK, scales) + (() if row_scales is None else (row_scales,))
    whole = lambda shape: pl.BlockSpec(shape, lambda program, split: (0,) * len(shape))  # noqa: E731
    num_programs = pl.cdiv(num_rows, tiles.block_m) * pl.cdiv(n_dim, tiles.block_n)
    split = tiles.k_splits > 1
    out_shape = (tiles.k_splits, num_rows, n_dim) if split else (num_rows, n_dim)
    y = pl.pallas_call(
        kernel,
        grid=(num_programs, tiles.k_splits),
        in_specs=[whole(op.shape) for op in operands],
        out_specs=whole(out_shape),
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32 if split else out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="w8a8_linear" if row_scales is not None else "weight_only_linear",
    )(*operands)
    return jnp.sum(y, axis=0).astype(out_dtype) if split else y
