"""MoE on GPU, Pallas with the Triton lowering: the grouped matmul and its weight gradient (`gmm`), the fused
gather + gate/up + SwiGLU and down + scatter kernels over rows sorted by expert (`fused`), the routed experts of a
few tokens row by row (`decode`), the weight-only variants of those three for block-FP8 and MXFP4 experts
(`weight_only`, the same kernels over the quantised weight-tile loaders of `weight_tiles`) and the router's
expert selection (`routing`). The names below are the variants' surface for tests and benchmarks; everything
else is internal."""

from pallas_kernels.moe.gpu_triton.decode import routed_experts_gpu
from pallas_kernels.moe.gpu_triton.fused import down_scatter_gpu, gather_swiglu_gpu
from pallas_kernels.moe.gpu_triton.gmm import grouped_matmul_gpu, grouped_weight_grad_gpu
from pallas_kernels.moe.gpu_triton.grouped import MIN_ROW_TILE, max_row_tiles, row_tile_sizes, row_tiles
from pallas_kernels.moe.gpu_triton.routing import select_experts_gpu
from pallas_kernels.moe.gpu_triton.weight_only import (
    down_scatter_weight_only_gpu,
    gather_swiglu_weight_only_gpu,
    routed_experts_weight_only_gpu,
)

__all__ = [
    "MIN_ROW_TILE",
    "down_scatter_gpu",
    "down_scatter_weight_only_gpu",
    "gather_swiglu_gpu",
    "gather_swiglu_weight_only_gpu",
    "grouped_matmul_gpu",
    "grouped_weight_grad_gpu",
    "max_row_tiles",
    "routed_experts_gpu",
    "routed_experts_weight_only_gpu",
    "row_tile_sizes",
    "row_tiles",
    "select_experts_gpu",
]
