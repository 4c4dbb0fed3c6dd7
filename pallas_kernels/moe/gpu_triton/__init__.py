"""MoE on GPU, Pallas with the Triton lowering: the grouped matmul and its weight gradient (`gmm`), the fused
gather + gate/up + SwiGLU and down + scatter kernels over rows sorted by expert (`fused`), the routed experts of a
few tokens row by row (`decode`) and the router's expert selection (`routing`). The names below are the variant's
surface for tests and benchmarks; everything else is internal."""

from pallas_kernels.moe.gpu_triton.decode import routed_experts_gpu
from pallas_kernels.moe.gpu_triton.fused import down_scatter_gpu, gather_swiglu_gpu
from pallas_kernels.moe.gpu_triton.gmm import (
    MIN_ROW_TILE,
    grouped_matmul_gpu,
    grouped_weight_grad_gpu,
    max_row_tiles,
    row_tile_sizes,
    row_tiles,
)
from pallas_kernels.moe.gpu_triton.routing import select_experts_gpu

__all__ = [
    "MIN_ROW_TILE",
    "down_scatter_gpu",
    "gather_swiglu_gpu",
    "grouped_matmul_gpu",
    "grouped_weight_grad_gpu",
    "max_row_tiles",
    "routed_experts_gpu",
    "row_tile_sizes",
    "row_tiles",
    "select_experts_gpu",
]
