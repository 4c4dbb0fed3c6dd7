"""The routed-expert FFN on GPU as two fused grouped matmuls (Pallas, Triton lowering) over rows sorted by
expert, with no sorted copy of the activations and no unsort:

- `gather_swiglu_gpu`: row r of the sorted order reads x[source[r]] straight from the unsorted activations
  (a gathered load per K tile), multiplies it by its expert's gate and up tiles for the same columns (two fp32
  accumulators, one pass over the rows) and stores swiglu(gate, up) in x's dtype: h [R, I] in sorted order;
- `down_scatter_gpu`: h's sorted rows times their expert's down weight, scaled by the row's weight in fp32,
  each stored to its original row dest[r] (a scattered store): y [R, D] in the callers' order, so that the
  combine of a token's top-k rows is a plain sum.

Both reuse the grouped matmul's row tiling and K loop (`gmm.py`): tiles never cross a
group, a tail tile (rows past sum(group_sizes)) stores zeros; dest must be a permutation of [0, R), so every
output row has exactly one owner. The expert weights are read through a weight-tile loader (`weight_tiles`):
dense ones cast to the activation dtype, block FP8 or MXFP4 ones read as stored and dequantised on chip (the
weight-only variants, `weight_only`: these entry points, refusing dense weights).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.moe import tuned
from pallas_kernels.moe.gpu_triton.gmm import call_over_row_tiles, output_tile, row_tile_settings, tile_products
from pallas_kernels.moe.gpu_triton.masked import mask_2d, masked_load
from pallas_kernels.moe.gpu_triton.weight_tiles import Dense, expert_tiles, kernel_operands, weight_format
from pallas_kernels.moe.reference import swiglu


def _row_indices(index_ref, row0, rows_ok_M, *, block_m: int, fill: int):
    """index_ref[row0 : row0 + block_m] as int32 [block_m], `fill` (an index past the indexed array) on rows
    outside the tile: a masked store through it then writes nothing, in interpret mode too."""
    return plgpu.load(index_ref.at[pl.ds(row0, block_m)], mask=rows_ok_M, other=fill)


def _columns(col0, block: int):
    return (col0 + jnp.arange(block))[None, :]


def _gather_swiglu_kernel(
    group_ref,
    row_start_ref,
    row_end_ref,
    source_ref,
    x_ref,
    *refs,
    formats,
    limit: float | None,
    weight_left: bool,
    column_tile,
    block_m: int,
    block_n: int,
    block_k: int,
    mask_n: bool,
    mask_k: bool,
):
    *weight_refs, h_ref = refs
    group, row0, col0, rows_ok_M, cols_ok_N = output_tile(
        group_ref,
        row_start_ref,
        row_end_ref,
        h_ref.shape[1],
        column_tile=column_tile,
        block_m=block_m,
        block_n=block_n,
        mask_n=mask_n,
    )
    source_M1 = _row_indices(source_ref, row0, rows_ok_M, block_m=block_m, fill=x_ref.shape[0])[:, None]

    def load_lhs(k0, k_ok_K):
        return masked_load(x_ref.at[source_M1, _columns(k0, block_k)], mask_2d(rows_ok_M, k_ok_K))

    gate_MN, up_MN = tile_products(
        load_lhs,
        expert_tiles(weight_refs, formats),
        group,
        col0,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        cols_ok_N=cols_ok_N,
        mask_k=mask_k,
        weight_left=weight_left,
    )
    plgpu.store(
        h_ref.at[pl.ds(row0, block_m), pl.ds(col0, block_n)],
        swiglu(gate_MN, up_MN, limit).astype(h_ref.dtype),
        mask=mask_2d(rows_ok_M, cols_ok_N),
    )


def _down_scatter_kernel(
    group_ref,
    row_start_ref,
    row_end_ref,
    dest_ref,
    row_weight_ref,
    h_ref,
    *refs,
    formats,
    weight_left: bool,
    column_tile,
    block_m: int,
    block_n: int,
    block_k: int,
    mask_n: bool,
    mask_k: bool,
):
    *weight_refs, y_ref = refs
    group, row0, col0, rows_ok_M, cols_ok_N = output_tile(
        group_ref,
        row_start_ref,
        row_end_ref,
        y_ref.shape[1],
        column_tile=column_tile,
        block_m=block_m,
        block_n=block_n,
        mask_n=mask_n,
    )

    def load_lhs(k0, k_ok_K):
        return masked_load(h_ref.at[pl.ds(row0, block_m), pl.ds(k0, block_k)], mask_2d(rows_ok_M, k_ok_K))

    (acc_MN,) = tile_products(
        load_lhs,
        expert_tiles(weight_refs, formats),
        group,
        col0,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        cols_ok_N=cols_ok_N,
        mask_k=mask_k,
        weight_left=weight_left,
    )
    row_weight_M = masked_load(row_weight_ref.at[pl.ds(row0, block_m)], rows_ok_M)
    dest_M1 = _row_indices(dest_ref, row0, rows_ok_M, block_m=block_m, fill=y_ref.shape[0])[:, None]
    plgpu.store(
        y_ref.at[dest_M1, _columns(col0, block_n)],
        (acc_MN * row_weight_M[:, None]).astype(y_ref.dtype),
        mask=mask_2d(rows_ok_M, cols_ok_N),
    )


_TILE_ARGS = (
    "block_m",
    "block_n",
    "block_k",
    "num_warps",
    "num_stages",
    "min_block_m",
    "weight_left",
    "fill_tail",
    "interpret",
)


def _over_row_tiles(
    kernel,
    group_sizes_G,
    operands,
    requested_tiles,
    *,
    num_rows: int,
    n_dim: int,
    k_dim: int,
    dtype,
    table,
    min_block_m: int | None,
    fill_tail: bool,
    interpret: bool,
    name: str,
):
    """[num_rows, n_dim] in dtype from `kernel` over the row tiles of the groups (empty for no rows); tiles:
    the requested (block_m, block_n, block_k, num_warps, num_stages), None entries from the defaults;
    min_block_m: the smallest row tile a partial one shrinks to (`gmm_gpu.row_tile_sizes`); fill_tail False:
    rows past sum(group_sizes) are not written (undefined); table: the `tuned` table of the defaults."""
    if num_rows == 0:
        return jnp.zeros((0, n_dim), dtype)
    settings = row_tile_settings(
        dtype,
        requested_tiles,
        num_rows=num_rows,
        num_groups=group_sizes_G.shape[0],
        n_dim=n_dim,
        k_dim=k_dim,
        table=table,
    )
    return call_over_row_tiles(
        kernel,
        group_sizes_G,
        operands,
        jax.ShapeDtypeStruct((num_rows, n_dim), dtype),
        settings,
        num_rows=num_rows,
        n_dim=n_dim,
        k_dim=k_dim,
        interpret=interpret,
        name=name,
        min_block_m=min_block_m,
        fill_tail=fill_tail,
    )


def _launch_defaults(formats, tables, weight_left: bool | None, *, num_rows: int, num_groups: int):
    """(the `tuned` table of default tiles, weight_left): tables[0] for dense weights, tables[1] for quantised
    ones (read as stored); weight_left None: False for dense weights, `tuned.WEIGHT_LEFT_QUANTIZED` by the rows'
    bucket for quantised ones."""
    if all(isinstance(f, Dense) for f in formats):
        return tables[0], bool(weight_left)
    if weight_left is None:
        weight_left = tuned.rows_bucket(num_rows, num_groups) in tuned.WEIGHT_LEFT_QUANTIZED
    return tables[1], weight_left


def _read_as_stored(named, dtype):
    """(formats, the kernel's operands) of the (weight, name) pairs: dense ones cast to dtype, quantised ones as
    stored (`weight_tiles`)."""
    formats = tuple(weight_format(w, name) for w, name in named)
    operands = tuple(a for (w, name), f in zip(named, formats) for a in kernel_operands(w, f, dtype, name))
    return formats, operands


@functools.partial(jax.jit, static_argnames=("limit", *_TILE_ARGS))
def gather_swiglu_gpu(
    x_XD,
    source_R,
    group_sizes_G,
    gate_GID,
    up_GID,
    *,
    limit: float | None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_block_m: int | None = None,
    weight_left: bool | None = None,
    fill_tail: bool = True,
    interpret: bool = False,
):
    """h [R, I] in x's dtype: h[r] = swiglu(x[source[r]] @ gate[g].T, x[source[r]] @ up[g].T, limit) for the
    rows r of group g (rows sorted by group, group_sizes [G], sum <= R), computed in fp32; rows past the sum
    get zeros (fill_tail) or are not written (undefined). source [R] int32 indexes x's rows (repeats allowed).
    gate and up [G, I, D]: arrays cast to x's dtype, or quantised (`weight_tiles`: each tile dequantised on chip to
    x's dtype). Tiles: None from `tuned.GATHER_SWIGLU` (quantised weights: `tuned.GATHER_SWIGLU_QUANTIZED`);
    weight_left: `gmm.tile_products`', None from `_launch_defaults`."""
    width, hidden = gate_GID.shape[1:]
    formats, weights = _read_as_stored(((gate_GID, "gate"), (up_GID, "up")), x_XD.dtype)
    table, weight_left = _launch_defaults(
        formats,
        (tuned.GATHER_SWIGLU, tuned.GATHER_SWIGLU_QUANTIZED),
        weight_left,
        num_rows=source_R.shape[0],
        num_groups=group_sizes_G.shape[0],
    )
    return _over_row_tiles(
        functools.partial(_gather_swiglu_kernel, formats=formats, limit=limit, weight_left=weight_left),
        group_sizes_G,
        (source_R.astype(jnp.int32), x_XD, *weights),
        (block_m, block_n, block_k, num_warps, num_stages),
        num_rows=source_R.shape[0],
        n_dim=width,
        k_dim=hidden,
        dtype=x_XD.dtype,
        table=table,
        min_block_m=min_block_m,
        fill_tail=fill_tail,
        interpret=interpret,
        name="gather_swiglu",
    )


@functools.partial(jax.jit, static_argnames=_TILE_ARGS)
def down_scatter_gpu(
    h_RI,
    dest_R,
    row_weight_R,
    group_sizes_G,
    down_GDI,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_block_m: int | None = None,
    weight_left: bool | None = None,
    fill_tail: bool = True,
    interpret: bool = False,
):
    """y [R, D] in h's dtype: y[dest[r]] = row_weight[r] * (h[r] @ down[g].T) for the rows r of group g (rows
    sorted by group, group_sizes [G], sum <= R), accumulated and weighted in fp32; rows past the sum store
    zeros (fill_tail) or nothing (their dest rows undefined). dest [R] int32 must be a permutation of [0, R);
    row_weight [R] fp32. down [G, D, I]: as gate for `gather_swiglu_gpu`. Tiles: None from `tuned.DOWN_SCATTER`
    (quantised weights: `tuned.DOWN_SCATTER_QUANTIZED`); weight_left: `gmm.tile_products`', None from
    `_launch_defaults`."""
    hidden, width = down_GDI.shape[1:]
    formats, weights = _read_as_stored(((down_GDI, "down"),), h_RI.dtype)
    table, weight_left = _launch_defaults(
        formats,
        (tuned.DOWN_SCATTER, tuned.DOWN_SCATTER_QUANTIZED),
        weight_left,
        num_rows=h_RI.shape[0],
        num_groups=group_sizes_G.shape[0],
    )
    return _over_row_tiles(
        functools.partial(_down_scatter_kernel, formats=formats, weight_left=weight_left),
        group_sizes_G,
        (dest_R.astype(jnp.int32), row_weight_R.astype(jnp.float32), h_RI, *weights),
        (block_m, block_n, block_k, num_warps, num_stages),
        num_rows=h_RI.shape[0],
        n_dim=hidden,
        k_dim=width,
        dtype=h_RI.dtype,
        table=table,
        min_block_m=min_block_m,
        fill_tail=fill_tail,
        interpret=interpret,
        name="down_scatter",
    )
