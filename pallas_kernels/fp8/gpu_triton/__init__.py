"""Block-FP8 linear maps on GPU, Pallas with the Triton lowering: weight-only (`weight_only`) and W8A8 (`w8a8`,
prefill), both over one block-scaled matmul kernel (`block_scaled`), and the decode-shaped weight-only kernel
(`gemv`, a few rows). `fp8_dot` is the FP8 tile product with tensor-core accumulation that the W8A8 kernels here
and in `pallas_kernels.moe` share. The names below are the variants' surface for tests and benchmarks; everything
else is internal."""

from pallas_kernels.fp8.gpu_triton.gemv import (
    weight_only_gemv_gpu,
    weight_only_gemv_many_gpu,
    weight_only_gemv_partials_gpu,
)
from pallas_kernels.fp8.gpu_triton.w8a8 import w8a8_linear_gpu, w8a8_linear_tc_acc_gpu
from pallas_kernels.fp8.gpu_triton.weight_only import weight_only_linear_gpu

__all__ = [
    "w8a8_linear_gpu",
    "w8a8_linear_tc_acc_gpu",
    "weight_only_gemv_gpu",
    "weight_only_gemv_many_gpu",
    "weight_only_gemv_partials_gpu",
    "weight_only_linear_gpu",
]
