"""The routed-expert FFN on GPU as two fused grouped matmuls (Pallas, Triton lowering) over rows sorted by
expert, with no sorted copy of the activations and no unsort:

- `gather_swiglu_gpu`: row r of the sorted order reads x[source[r]] straight from the unsorted activations
  (a gathered load per K tile), multiplies it by its expert's gate and up tiles for the same columns (two fp32
  accumulators, one pass over the rows) and stores swiglu(gate, up) in x's dtype: h [R, I] in sorted order;
- `down_scatter_gpu`: h's sorted rows times their expert's down weight, scaled by the row's weight in fp32,
  each stored to its original row dest[r] (a scattered store): y [R, D] in the callers' order, so that the
  combine of a token's top-k rows is a plain sum.

Both are bodies over the grouped kernels' skeleton (`grouped`: the row tiles, the K loop, the stores): tiles
never cross a group, a tail tile (rows past sum(group_sizes)) stores zeros; dest must be a permutation of [0, R),
so every output row has exactly one owner. The expert weights are read through a weight-tile loader (`weight_tiles`):
dense ones cast to the activation dtype, block FP8 or MXFP4 ones read as stored and dequantised on chip (the
weight-only variants, `weight_only`: these entry points, refusing dense weights).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.moe import tuned
from pallas_kernels.moe.gpu_triton.grouped import Tile, grouped_call, launch_settings
from pallas_kernels.moe.gpu_triton.weight_tiles import Dense, expert_tiles, kernel_operands, weight_format
from pallas_kernels.moe.reference import swiglu


def _gather_swiglu_kernel(tile: Tile, source_ref, x_ref, *refs, formats, limit: float | None, weight_left: bool):
    *weight_refs, h_ref = refs
    source_M1 = tile.row_indices(source_ref, fill=x_ref.shape[0])[:, None]
    gate_MN, up_MN = tile.weight_products(
        lambda k0, k_ok_K: tile.gathered(x_ref, source_M1, k0, k_ok_K),
        expert_tiles(weight_refs, formats),
        weight_left=weight_left,
    )
    tile.store(h_ref, swiglu(gate_MN, up_MN, limit))


def _down_scatter_kernel(tile: Tile, dest_ref, row_weight_ref, h_ref, *refs, formats, weight_left: bool):
    *weight_refs, y_ref = refs
    (acc_MN,) = tile.weight_products(
        functools.partial(tile.rows, h_ref), expert_tiles(weight_refs, formats), weight_left=weight_left
    )
    tile.scatter(y_ref, dest_ref, row_weight_ref, acc_MN)


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


def _fused_call(
    body,
    formats,
    tables,
    group_sizes_G,
    operands,
    out_shape,
    requested: tuple,
    weight_left: bool | None,
    *,
    k_dim: int,
    min_block_m: int | None,
    fill_tail: bool,
    interpret: bool,
    name: str,
):
    """`grouped.grouped_call` of body(tile, *operand_refs, out_ref, formats=, weight_left=) over out_shape [R, N]
    (out's dtype: the products' too), the weights in `formats` the last operands, at the requested (block_m,
    block_n, block_k, num_warps, num_stages): None ones from the table of `tables` (dense, quantised) that
    `_launch_defaults` picks, which also settles a weight_left of None."""
    num_rows, n_dim = out_shape.shape
    num_groups = group_sizes_G.shape[0]
    table, weight_left = _launch_defaults(formats, tables, weight_left, num_rows=num_rows, num_groups=num_groups)
    tiles = launch_settings(
        table, requested, dtype=out_shape.dtype, num_rows=num_rows, num_groups=num_groups, n_dim=n_dim, k_dim=k_dim
    )
    return grouped_call(
        functools.partial(body, formats=formats, weight_left=weight_left),
        group_sizes_G,
        operands,
        out_shape,
        tiles,
        k_dim=k_dim,
        interpret=interpret,
        name=name,
        min_block_m=min_block_m,
        fill_tail=fill_tail,
    )


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
    weight_left: `grouped.Tile.weight_products`', None from `_launch_defaults`."""
    width, hidden = gate_GID.shape[1:]
    formats, weights = _read_as_stored(((gate_GID, "gate"), (up_GID, "up")), x_XD.dtype)
    return _fused_call(
        functools.partial(_gather_swiglu_kernel, limit=limit),
        formats,
        (tuned.GATHER_SWIGLU, tuned.GATHER_SWIGLU_QUANTIZED),
        group_sizes_G,
        (source_R.astype(jnp.int32), x_XD, *weights),
        jax.ShapeDtypeStruct((source_R.shape[0], width), x_XD.dtype),
        (block_m, block_n, block_k, num_warps, num_stages),
        weight_left,
        k_dim=hidden,
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
    (quantised weights: `tuned.DOWN_SCATTER_QUANTIZED`); weight_left: `grouped.Tile.weight_products`', None
    from `_launch_defaults`."""
    hidden, width = down_GDI.shape[1:]
    formats, weights = _read_as_stored(((down_GDI, "down"),), h_RI.dtype)
    return _fused_call(
        _down_scatter_kernel,
        formats,
        (tuned.DOWN_SCATTER, tuned.DOWN_SCATTER_QUANTIZED),
        group_sizes_G,
        (dest_R.astype(jnp.int32), row_weight_R.astype(jnp.float32), h_RI, *weights),
        jax.ShapeDtypeStruct((h_RI.shape[0], hidden), h_RI.dtype),
        (block_m, block_n, block_k, num_warps, num_stages),
        weight_left,
        k_dim=width,
        min_block_m=min_block_m,
        fill_tail=fill_tail,
        interpret=interpret,
        name="down_scatter",
    )
