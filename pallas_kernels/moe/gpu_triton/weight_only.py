"""Weight-only quantised MoE kernels on GPU (Pallas, Triton lowering): the fused gather + gate/up + SwiGLU and
down + weighted scatter kernels (`fused`) and the decode row kernels (`decode`), run with block-FP8 or MXFP4
experts read as stored (`weight_tiles`): each weight tile is loaded in its stored bytes (e4m3: half of bf16's,
packed E2M1: a quarter), dequantised on chip with its scales, and multiplied in the activation dtype (bf16
tensor cores, IEEE fp32 for fp32) into fp32 accumulators. The same kernel bodies as the dense variants; only
the weight-tile loader differs. No dense copy of an expert weight is ever written.

Tiles: the dense variants' tuned tables (the same elements a tile; not measured with quantised weights yet:
scripts/bench_moe_quantized.py sweeps them). At the grouped kernels' block_k of 64 / 128 a tile of a 128 x 128
block-FP8 weight takes one scale.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.moe.gpu_triton.decode import routed_experts_call
from pallas_kernels.moe.gpu_triton.fused import down_scatter_call, gather_swiglu_call
from pallas_kernels.moe.gpu_triton.weight_tiles import is_quantized

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


def _require_quantized(**weights) -> None:
    for name, weight in weights.items():
        if not is_quantized(weight):
            raise ValueError(
                f"{name}: the weight-only kernels take a quantised weight (values and scales: block FP8 or "
                f"MXFP4), got a dense {weight.dtype} {tuple(weight.shape)}; dense weights run the 'gpu_triton' variant"
            )


@functools.partial(jax.jit, static_argnames=("limit", *_TILE_ARGS))
def gather_swiglu_weight_only_gpu(
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
    weight_left: bool = False,
    fill_tail: bool = True,
    interpret: bool = False,
):
    """`fused.gather_swiglu_gpu` with gate and up [G, I, D] quantised (block FP8 or MXFP4), dequantised on chip
    to x's dtype. Tiles: None from `tuned.GATHER_SWIGLU`; weight_left: the products with the weight tile as the
    MMA's first operand (`gmm.tile_products`)."""
    _require_quantized(gate=gate_GID, up=up_GID)
    return gather_swiglu_call(
        x_XD,
        source_R,
        group_sizes_G,
        gate_GID,
        up_GID,
        limit=limit,
        tiles=(block_m, block_n, block_k, num_warps, num_stages),
        min_block_m=min_block_m,
        fill_tail=fill_tail,
        interpret=interpret,
        weight_left=weight_left,
    )


@functools.partial(jax.jit, static_argnames=_TILE_ARGS)
def down_scatter_weight_only_gpu(
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
    weight_left: bool = False,
    fill_tail: bool = True,
    interpret: bool = False,
):
    """`fused.down_scatter_gpu` with down [G, D, I] quantised, dequantised on chip to h's dtype. Tiles: None from
    `tuned.DOWN_SCATTER`; weight_left as for `gather_swiglu_weight_only_gpu`."""
    _require_quantized(down=down_GDI)
    return down_scatter_call(
        h_RI,
        dest_R,
        row_weight_R,
        group_sizes_G,
        down_GDI,
        tiles=(block_m, block_n, block_k, num_warps, num_stages),
        min_block_m=min_block_m,
        fill_tail=fill_tail,
        interpret=interpret,
        weight_left=weight_left,
    )


@functools.partial(jax.jit, static_argnames=("limit", "shared_limit", "interpret", "swiglu_tiles", "down_tiles"))
def routed_experts_weight_only_gpu(
    x_TD,
    weights_TK,
    experts_TK,
    gate_EID,
    up_EID,
    down_EDI,
    shared=None,
    *,
    limit: float | None,
    shared_limit: float | None = None,
    interpret: bool = False,
    swiglu_tiles: tuple[int | None, ...] = (None,) * 4,
    down_tiles: tuple[int | None, ...] = (None,) * 4,
):
    """`decode.routed_experts_gpu` with the routed experts quantised (block FP8 or MXFP4), each tile dequantised
    on chip to fp32; the shared expert (if any) dense or quantised, in a format of its own. Tiles: None from
    `tuned.ROUTED_SWIGLU` / `tuned.ROUTED_DOWN`."""
    _require_quantized(gate=gate_EID, up=up_EID, down=down_EDI)
    return routed_experts_call(
        x_TD,
        weights_TK,
        experts_TK,
        gate_EID,
        up_EID,
        down_EDI,
        shared,
        limit=limit,
        shared_limit=shared_limit,
        interpret=interpret,
        swiglu_tiles=swiglu_tiles,
        down_tiles=down_tiles,
    )
