"""The routed-expert FFN in W8A8 on GPU (prefill; Pallas, Triton lowering): the fused kernels of `fused.py` with
block-FP8 expert weights (e4m3 values [G, N, K], fp32 scales per block[0] x block[1] block, spec §6.2) and FP8 x FP8
products, as SGLang serves the FP8 checkpoints:

- `gather_swiglu_w8a8_gpu`: x quantised per token in 1 x block[1] groups before the kernel
  (`fp8.reference.quantize_activations`, one XLA pass over the unsorted tokens); row r of the sorted order gathers
  x_q[source[r]] and its group scales; each K step (one weight block) adds the FP8 products with the expert's gate
  and up blocks, times the row's activation scale and the block's weight scale, to two fp32 accumulators
  (`fp8_dot.scaled_fp8_product`); then SwiGLU in fp32, and h quantised in the epilogue: a program's column tile is
  exactly one 1 x block[1] group, so it stores h_q [R, I] e4m3 and h_scale [R, ceil(I / block[1])];
- `down_scatter_w8a8_gpu`: h_q's sorted rows times the expert's down blocks the same way, weighted per row in
  fp32 and stored to dest[r];
- `w8a8_expert_rows`: the two in turn on the values and scales of three block-FP8 expert weights.

Both are bodies over the grouped kernels' skeleton (`grouped`: tiles never cross a group, a group's last tile
shrunk, tail tiles storing zeros, dest a permutation), their K steps FP8 products scaled per block
(`_scaled_step`); the down kernel's program may walk several column tiles in one pipelined loop (`columns`).
`moe.w8a8_reference` is the same arithmetic in jnp.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.fp8.gpu_triton.fp8_dot import scaled_fp8_product
from pallas_kernels.fp8.reference import quantize_activations, quantize_groups
from pallas_kernels.moe import tuned
from pallas_kernels.moe.gpu_triton.grouped import Tile, grouped_call, launch_settings
from pallas_kernels.moe.gpu_triton.weight_tiles import (
    BlockFP8,
    StoredWeight,
    expert_tiles,
    kernel_operands,
    pairs_needed,
)
from pallas_kernels.moe.reference import swiglu
from pallas_kernels.triton_masked import masked_load

_TILE_ARGS = ("block_m", "num_warps", "num_stages", "min_block_m", "fill_tail", "interpret")


def _scaled_step(load_lhs, weights):
    """step_products(tile, step, k0, k_ok_K) for `Tile.accumulate` / `Tile.walk_columns`: one product a block-FP8
    `ExpertTiles` in weights ([G, N, K], the values as stored and fp32 scales [G, N blocks, K blocks]), the FP8
    product of the lhs block with the tile's weight block, times the lhs rows' scales and the weight block's scale.
    load_lhs(tile, step, k0, k_ok_K) -> (lhs_q [block_m, block_k] e4m3, zeros outside the valid rows and K;
    row_scale [block_m])."""

    def step_products(tile: Tile, step, k0, k_ok_K):
        lhs_MK, row_scale_M = load_lhs(tile, step, k0, k_ok_K)
        scale_row = tile.col0 // weights[0].format.block[0]
        # every weight's scale read before the first product: Triton keeps the order, so a scale read after a
        # product's wait would hold the next product until its load returns
        weight_scales = [weight.refs[1][tile.group, scale_row, step] for weight in weights]
        return tuple(
            scaled_fp8_product(
                lhs_MK,
                tile.weight_tile(functools.partial(weight.format.load_e4m3, weight.refs[0]), k0, k_ok_K),
                row_scale_M,
                weight_scale,
            )
            for weight, weight_scale in zip(weights, weight_scales)
        )

    return step_products


def _gather_swiglu_kernel(
    tile: Tile,
    source_ref,
    x_q_ref,
    x_scale_ref,
    gate_values_ref,
    gate_scales_ref,
    up_values_ref,
    up_scales_ref,
    h_q_ref,
    h_scale_ref,
    *,
    limit: float | None,
    weight_format: BlockFP8,
):
    source_M = tile.row_indices(source_ref, fill=x_q_ref.shape[0])

    def load_lhs(tile, step, k0, k_ok_K):
        x_q_MK = tile.gathered(x_q_ref, source_M[:, None], k0, k_ok_K)
        return x_q_MK, masked_load(x_scale_ref.at[source_M, step], tile.rows_ok_M)

    weights = expert_tiles((gate_values_ref, gate_scales_ref, up_values_ref, up_scales_ref), (weight_format,) * 2)
    step_products = _scaled_step(load_lhs, weights)
    gate_MN, up_MN = tile.accumulate(functools.partial(step_products, tile), 2)
    h_q_MN, h_scale_M = quantize_groups(swiglu(gate_MN, up_MN, limit))  # masked columns are swiglu(0, 0) = 0
    tile.store(h_q_ref, h_q_MN)
    plgpu.store(h_scale_ref.at[pl.ds(tile.row0, tile.shape.block_m), tile.column_tile], h_scale_M, mask=tile.rows_ok_M)


def _down_scatter_kernel(
    tile: Tile,
    dest_ref,
    row_weight_ref,
    h_q_ref,
    h_scale_ref,
    down_values_ref,
    down_scales_ref,
    y_ref,
    *,
    weight_format: BlockFP8,
    columns: int,
):
    def load_lhs(tile, step, k0, k_ok_K):
        h_q_MK = tile.rows(h_q_ref, k0, k_ok_K)
        return h_q_MK, masked_load(h_scale_ref.at[pl.ds(tile.row0, tile.shape.block_m), step], tile.rows_ok_M)

    step_products = _scaled_step(load_lhs, expert_tiles((down_values_ref, down_scales_ref), (weight_format,)))
    tile.walk_columns(
        columns, step_products, 1, lambda column_tile, accs: column_tile.scatter(y_ref, dest_ref, row_weight_ref, *accs)
    )


def takes_block(block: tuple[int, int]) -> bool:
    """Whether the kernels take a weight block: block[1] a power of two >= 32 (the FP8 dot's K) dividing block[0]."""
    block_rows, block_cols = block
    return block_cols >= 32 and not block_cols & (block_cols - 1) and not block_rows % block_cols


def _check_weight(name: str, values, scales, block: tuple[int, int]) -> None:
    """One clear error for a weight the kernels cannot take: e4m3 [G, N, K] values, scales [G, ceil(N / block[0]),
    ceil(K / block[1])], block powers of two with block[1] >= 32 (the FP8 dot's K) dividing block[0]."""
    block_rows, block_cols = block
    if not takes_block(block):
        raise ValueError(f"W8A8 experts: block {block} must be powers of two, block[1] >= 32 dividing block[0]")
    num_groups, n_dim, k_dim = values.shape
    expected = (num_groups, -(-n_dim // block_rows), -(-k_dim // block_cols))
    if values.dtype != jnp.float8_e4m3fn or tuple(scales.shape) != expected:
        raise ValueError(
            f"W8A8 experts: {name} must be float8_e4m3fn values [G, N, K] with scales {list(expected)} for block "
            f"{block}, got {values.dtype} {list(values.shape)} and scales {list(scales.shape)}"
        )


def _weight_operands(name: str, values, scales, block: tuple[int, int]) -> tuple[BlockFP8, tuple[jax.Array, ...]]:
    """The kernel's format and arrays of a block-FP8 weight: the values as stored (as uint16 pairs only where
    `weight_tiles.pairs_needed`), fp32 scales; an operand int32 offsets cannot index is refused."""
    weight_format = BlockFP8(block, paired=pairs_needed(values))
    return weight_format, kernel_operands(StoredWeight(values, scales), weight_format, name=f"W8A8 experts: {name}")


def _w8a8_call(
    body,
    group_sizes_G,
    operands,
    out_shape,
    table,
    requested: tuple,
    *,
    dtype,
    block: tuple[int, int],
    gathers: bool,
    k_dim: int,
    min_block_m: int | None,
    fill_tail: bool,
    interpret: bool,
    name: str,
    columns: int = 1,
):
    """`grouped.grouped_call` of body(tile, *operand_refs, *out_refs) over out_shape (the first output [R, N]) at
    the requested (block_m, block_n, num_warps, num_stages), None ones from `table` for dtype; the K step is
    block[1]; the column tile is block[1] for the gate/up kernel (one group of h: `gathers`, block_n not given), at
    most block[0] otherwise."""
    block_m, block_n, num_warps, num_stages = requested
    num_rows, n_dim = jax.tree.leaves(out_shape)[0].shape
    settings = launch_settings(
        table,
        (block_m, block_n, None, num_warps, num_stages),
        dtype=dtype,
        num_rows=num_rows,
        num_groups=group_sizes_G.shape[0],
        n_dim=n_dim,
        k_dim=block[1],
    )
    block_n = block[1] if gathers else min(settings.block_n, block[0])
    return grouped_call(
        body,
        group_sizes_G,
        operands,
        out_shape,
        dataclasses.replace(settings, block_n=block_n, block_k=block[1]),
        k_dim=k_dim,
        interpret=interpret,
        name=name,
        min_block_m=min_block_m,
        fill_tail=fill_tail,
        columns=columns,
    )


@functools.partial(jax.jit, static_argnames=("limit", "block", *_TILE_ARGS))
def gather_swiglu_w8a8_gpu(
    x_XD,
    source_R,
    group_sizes_G,
    gate_values_GID,
    gate_scales,
    up_values_GID,
    up_scales,
    *,
    limit: float | None,
    block: tuple[int, int],
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_block_m: int | None = None,
    fill_tail: bool = True,
    interpret: bool = False,
):
    """(h_q [R, I] float8_e4m3fn, h_scale [R, ceil(I / block[1])] float32): h = swiglu(x[source[r]] @ gate[g].T,
    x[source[r]] @ up[g].T, limit) for the rows r of group g (rows sorted by group, group_sizes [G], sum <= R) in
    W8A8 (module docstring), quantised per row in 1 x block[1] groups (`fp8.reference.quantize_groups`): h[r, i] =
    h_q[r, i] * h_scale[r, i // block[1]]. Rows past the sum get h = 0 (fill_tail) or are not written. source [R]
    int32 indexes x's rows (x [X, D], any float dtype). gate and up: block-FP8 [G, I, D] (values e4m3, scales
    [G, ceil(I / block[0]), ceil(D / block[1])]). The column tile is block[1] (one group of h); the other tiles:
    None from `moe.tuned.GATHER_SWIGLU_W8A8` (min_block_m: `GATHER_SWIGLU_W8A8_MIN_BLOCK_M`)."""
    for name, values, scales in (("gate", gate_values_GID, gate_scales), ("up", up_values_GID, up_scales)):
        _check_weight(name, values, scales, block)
    num_rows, (width, hidden) = source_R.shape[0], gate_values_GID.shape[1:]
    num_h_groups = -(-width // block[1])
    out_shape = (
        jax.ShapeDtypeStruct((num_rows, width), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((num_rows, num_h_groups), jnp.float32),
    )
    x_q_XD, x_scale_XG = quantize_activations(x_XD, block[1])
    weight_format, gate_operands = _weight_operands("gate", gate_values_GID, gate_scales, block)
    _, up_operands = _weight_operands("up", up_values_GID, up_scales, block)
    return _w8a8_call(
        functools.partial(_gather_swiglu_kernel, limit=limit, weight_format=weight_format),
        group_sizes_G,
        (source_R.astype(jnp.int32), x_q_XD, x_scale_XG, *gate_operands, *up_operands),
        out_shape,
        tuned.GATHER_SWIGLU_W8A8,
        (block_m, None, num_warps, num_stages),
        dtype=x_XD.dtype,
        block=block,
        gathers=True,
        k_dim=hidden,
        min_block_m=tuned.GATHER_SWIGLU_W8A8_MIN_BLOCK_M if min_block_m is None else min_block_m,
        fill_tail=fill_tail,
        interpret=interpret,
        name="gather_swiglu_w8a8",
    )


@functools.partial(jax.jit, static_argnames=("block", "out_dtype", "block_n", "columns", *_TILE_ARGS))
def down_scatter_w8a8_gpu(
    h_q_RI,
    h_scale,
    dest_R,
    row_weight_R,
    group_sizes_G,
    down_values_GDI,
    down_scales,
    *,
    block: tuple[int, int],
    out_dtype=jnp.bfloat16,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_block_m: int | None = None,
    columns: int | None = None,
    fill_tail: bool = True,
    interpret: bool = False,
):
    """y [R, D] of out_dtype: y[dest[r]] = row_weight[r] * (h[r] @ down[g].T) for the rows r of group g (rows
    sorted by group, group_sizes [G], sum <= R), h given quantised as `gather_swiglu_w8a8_gpu` returns it (h_q
    [R, I] e4m3, h_scale [R, ceil(I / block[1])]), FP8 products scaled per K block, accumulated and weighted in
    fp32; rows past the sum store zeros (fill_tail) or nothing. dest [R] int32 must be a permutation of [0, R);
    row_weight [R] fp32. down: block-FP8 [G, D, I] (values e4m3, scales [G, ceil(D / block[0]), ceil(I /
    block[1])]). Tiles: None from `moe.tuned.DOWN_SCATTER_W8A8` (min_block_m: `DOWN_SCATTER_W8A8_MIN_BLOCK_M`); columns:
    the column tiles a program walks in one loop (`grouped.Tile.walk_columns`; None: `DOWN_SCATTER_W8A8_COLUMNS`)."""
    _check_weight("down", down_values_GDI, down_scales, block)
    num_rows, (hidden, width) = h_q_RI.shape[0], down_values_GDI.shape[1:]
    if h_q_RI.dtype != jnp.float8_e4m3fn or h_scale.shape != (num_rows, -(-width // block[1])):
        raise ValueError(
            f"W8A8 experts: h must be float8_e4m3fn [R, I] with scales [R, ceil(I / {block[1]})], got "
            f"{h_q_RI.dtype} {list(h_q_RI.shape)} and {list(h_scale.shape)}"
        )
    weight_format, down_operands = _weight_operands("down", down_values_GDI, down_scales, block)
    operands = (dest_R.astype(jnp.int32), row_weight_R.astype(jnp.float32), h_q_RI, h_scale.astype(jnp.float32))
    return _w8a8_call(
        functools.partial(
            _down_scatter_kernel,
            weight_format=weight_format,
            columns=tuned.DOWN_SCATTER_W8A8_COLUMNS if columns is None else columns,
        ),
        group_sizes_G,
        (*operands, *down_operands),
        jax.ShapeDtypeStruct((num_rows, hidden), out_dtype),
        tuned.DOWN_SCATTER_W8A8,
        (block_m, block_n, num_warps, num_stages),
        dtype=out_dtype,
        block=block,
        gathers=False,
        k_dim=width,
        min_block_m=tuned.DOWN_SCATTER_W8A8_MIN_BLOCK_M if min_block_m is None else min_block_m,
        fill_tail=fill_tail,
        interpret=interpret,
        name="down_scatter_w8a8",
        columns=tuned.DOWN_SCATTER_W8A8_COLUMNS if columns is None else columns,
    )


def w8a8_expert_rows(
    x_XD,
    source_R,
    order_R,
    row_weight_R,
    sizes_E,
    gate,
    up,
    down,
    limit: float | None,
    *,
    fill_tail: bool = True,
    interpret: bool = False,
):
    """[R, D] in x's dtype: both W8A8 kernels, the routed experts' rows as `pallas_kernels.moe.ops.moe_experts`
    computes them on its FUSED path (row order[r] = row_weight[r] * FFN_g(x[source[r]]) for the r-th row of the
    expert order), from block-FP8 experts: gate, up [G, I, D] and down [G, D, I], each anything with `values`,
    `scales` and `block` (`ling_jax.quantized.BlockFP8Weight`), one block for the three."""
    if not gate.block == up.block == down.block:
        raise ValueError(f"W8A8 experts: gate, up and down need one block, got {gate.block}, {up.block}, {down.block}")
    block = tuple(gate.block)
    h_q, h_scale = gather_swiglu_w8a8_gpu(
        x_XD,
        source_R,
        sizes_E,
        gate.values,
        gate.scales,
        up.values,
        up.scales,
        limit=limit,
        block=block,
        fill_tail=fill_tail,
        interpret=interpret,
    )
    return down_scatter_w8a8_gpu(
        h_q,
        h_scale,
        order_R,
        row_weight_R,
        sizes_E,
        down.values,
        down.scales,
        block=block,
        out_dtype=x_XD.dtype,
        fill_tail=fill_tail,
        interpret=interpret,
    )
