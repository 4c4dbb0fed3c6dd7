"""W8A8 block-FP8 linear on GPU, for prefill-sized calls: activations quantised per token in 1 x 128 groups
(`reference.quantize_activations`, one fused XLA pass), then FP8 x FP8 products on the tensor cores, each K
block's partial product scaled by its activation and weight scales (`block_scaled`).

Two variants of the same kernel: `w8a8_linear_gpu` ("gpu_triton") takes Pallas's FP8 dot, which Triton splits
into one CUDA-core add per wgmma instruction (`fp8_dot`'s docstring); `w8a8_linear_tc_acc_gpu`
("gpu_triton_tc_acc") accumulates each K block in the tensor cores (`fp8_dot.fp8_dot`) and has its own tiles."""

from __future__ import annotations

import functools

import jax

from pallas_kernels.fp8 import tuned
from pallas_kernels.fp8.gpu_triton.block_scaled import block_scaled_matmul, fit_tiles
from pallas_kernels.fp8.reference import quantize_activations
from pallas_kernels.tuning import lookup


@functools.partial(jax.jit, static_argnames=("block", "tiles", "tc_accumulated", "interpret"))
def w8a8_linear_gpu(
    x_MK,
    values_NK,
    scales,
    *,
    block: tuple[int, int],
    tiles: tuned.LinearTiles | None = None,
    tc_accumulated: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """y [M, N] in x's dtype: x [M, K] quantised to e4m3 per token in groups of block[1] inputs, times the
    block-FP8 weight (values [N, K] e4m3, scales [ceil(N / block[0]), ceil(K / block[1])]) transposed, fp32
    accumulation (`reference.w8a8_linear_reference` is the same sum). tc_accumulated: each K block's FP8 products
    accumulated in the tensor cores (module docstring: `w8a8_linear_tc_acc_gpu`). Tiles: None from `tuned.W8A8`
    (tc_accumulated: `tuned.W8A8_TC_ACC`)."""
    tiles = tiles or lookup(tuned.W8A8_TC_ACC if tc_accumulated else tuned.W8A8, dtype=x_MK.dtype)
    num_k_steps = -(-x_MK.shape[1] // block[1])
    tiles = fit_tiles(
        tiles, num_rows=x_MK.shape[0], n_dim=values_NK.shape[0], block_rows=block[0], num_k_steps=num_k_steps
    )
    x_q_MK, a_scale_MG = quantize_activations(x_MK, block[1])
    return block_scaled_matmul(
        x_q_MK,
        values_NK,
        scales,
        a_scale_MG,
        block=block,
        tiles=tiles,
        out_dtype=x_MK.dtype,
        interpret=interpret,
        tc_accumulated=tc_accumulated,
    )


# "gpu_triton_tc_acc": the same kernel with its own tiles, each K block accumulated in the tensor cores
w8a8_linear_tc_acc_gpu = functools.partial(w8a8_linear_gpu, tc_accumulated=True)
