"""Weight-only block-FP8 linear on GPU, for decode-sized calls (up to a decode batch of a few hundred rows):
y = x @ dequant(W)^T with the e4m3 weight read as stored (half the bytes of bf16) and each tile dequantised on
chip (`block_scaled`)."""

from __future__ import annotations

import functools

import jax

from pallas_kernels.fp8 import tuned
from pallas_kernels.fp8.gpu_triton.block_scaled import block_scaled_matmul, fit_tiles
from pallas_kernels.tuning import lookup


@functools.partial(jax.jit, static_argnames=("block", "tiles", "interpret"))
def weight_only_linear_gpu(
    x_MK,
    values_NK,
    scales,
    *,
    block: tuple[int, int],
    tiles: tuned.WeightOnlyTiles | None = None,
    interpret: bool = False,
) -> jax.Array:
    """y [M, N] in x's dtype: x [M, K] (bf16, fp16 or fp32) times the block-FP8 weight (values [N, K] e4m3,
    scales [ceil(N / block[0]), ceil(K / block[1])]) transposed; e4m3 tiles cast to x's dtype, products in x's
    dtype (fp32: IEEE), fp32 accumulation, each K block's partial product times its weight scale. Tiles: None
    from `tuned.WEIGHT_ONLY` by the row count (`tuned.weight_only_bucket`)."""
    tiles = tiles or lookup(tuned.WEIGHT_ONLY, dtype=x_MK.dtype, bucket=tuned.weight_only_bucket(x_MK.shape[0]))
    num_k_steps = -(-x_MK.shape[1] // block[1])
    tiles = fit_tiles(
        tiles, num_rows=x_MK.shape[0], n_dim=values_NK.shape[0], block_rows=block[0], num_k_steps=num_k_steps
    )
    return block_scaled_matmul(
        x_MK,
        values_NK,
        scales,
        None,
        block=block,
        tiles=tiles,
        out_dtype=x_MK.dtype,
        interpret=interpret,
        weight_left=tiles.weight_left,
    )
