"""The block-FP8 W8A8 linear as a persistent, warp-specialised Mosaic GPU kernel (`gpu_mosaic_grouped.grouped_call`
with one weight, every 128-row tile of x its own): `w8a8_linear_ws_mgpu`.

Against "gpu_mosaic" (`pallas_kernels.fp8.gpu_mosaic`: a CTA per 64 x block_n output tile, one warpgroup, each K
block's wgmma waited for and promoted in turn) this kernel runs one CTA an SM over the (128-row tile, column group)
items: a TMA warpgroup feeds two compute warpgroups of 64 rows that share each weight tile read from L2 (half the
weight traffic a row), one's promotion overlapping the other's wgmma. The arithmetic is the same: x quantised per
token in 1 x 128 groups (XLA, before the kernel), FP8 products of each 128-input block scaled by both scales and
summed in fp32.

It is "gpu_mosaic_ws" of `pallas_kernels.fp8.ops.VARIANTS["w8a8_linear"]`, a GPU's W8A8 kernel where it takes the
weight and K is at least tuned.MOSAIC_WS_MIN_K (1.11-1.17x "gpu_mosaic" at Ling-3.0-flash's prefill projections on
an H100, docs/benchmarks/matmul.md). GPU only: the Mosaic GPU interpreter does not run warp-specialised
pipelines; the CPU lowers it for CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.backend import device_cores
from pallas_kernels.fp8 import tuned
from pallas_kernels.fp8.gpu_mosaic import BLOCK_K, fits, quantized_rows
from pallas_kernels.fp8.gpu_mosaic_grouped import BLOCK_M, grouped_call, store_rows
from pallas_kernels.fp8.tuned import WarpSpecialisedTiles
from pallas_kernels.tuning import lookup

FALLBACK_CORES = 132  # an H100's / H200's SMs, for a program lowered for CUDA where no GPU is attached


class _OneExpert(NamedTuple):
    values: jax.Array  # [1, N, K] e4m3
    scales: jax.Array  # [1, N / 128, K / 128]


def fitted_tiles(tiles: WarpSpecialisedTiles, num_rows: int, n_dim: int) -> WarpSpecialisedTiles:
    """The tuned tiles fitted to a product of num_rows x n_dim outputs: a column tile wider than the weight's
    128-row block becomes one block where it does not divide n_dim or would make fewer items than the GPU has SMs
    (`device_cores`; FALLBACK_CORES lowering without a GPU), and the items hold one column tile where column
    groups would leave SMs idle (narrow products: KDA's joined f_a / g_a, 256 x 2560 over 8192 rows, 76.5 us at
    128 columns against 86.6 at 256); columns otherwise a divisor of the column tiles."""
    cores = device_cores("pallas_gpu") or FALLBACK_CORES
    row_tiles = -(-num_rows // BLOCK_M)
    if tiles.block_n > BLOCK_K and (n_dim % tiles.block_n or row_tiles * (n_dim // tiles.block_n) < cores):
        tiles = dataclasses.replace(tiles, block_n=BLOCK_K)
    tiles = _whole_groups(tiles, n_dim)
    if row_tiles * max(1, n_dim // tiles.block_n) // tiles.columns < cores:
        tiles = dataclasses.replace(tiles, columns=1)
    return tiles


def _whole_groups(tiles: WarpSpecialisedTiles, n_dim: int) -> WarpSpecialisedTiles:
    """tiles with columns cut to a divisor of the product's column tiles."""
    return dataclasses.replace(tiles, columns=math.gcd(tiles.columns, max(1, n_dim // tiles.block_n)))


def takes(x, weight) -> bool:
    """A 2-D weight of 128 x 128 blocks, N a multiple of the tuned block_n (`fitted_tiles`) and K of 128."""
    num_rows = x.size // x.shape[-1]
    tiles = fitted_tiles(lookup(tuned.W8A8_MOSAIC_WS, dtype=x.dtype), num_rows, weight.values.shape[0])
    return weight.values.ndim == 2 and fits(weight.values, weight.block, tiles.block_n)


@functools.partial(jax.jit, static_argnames=("block", "tiles", "interpret"))
def w8a8_linear_ws_mgpu(
    x_MK,
    values_NK,
    scales,
    *,
    block: tuple[int, int],
    tiles: WarpSpecialisedTiles | None = None,
    interpret: bool = False,
) -> jax.Array:
    """y [M, N] in x's dtype: `fp8.reference.w8a8_linear_reference`'s product (module docstring). values [N, K]
    e4m3, scales [N / 128, K / 128]. Tiles: None from `tuned.W8A8_MOSAIC_WS`, fitted to the product
    (`fitted_tiles`); given ones as they are (their column groups cut to a divisor of the column tiles)."""
    n_dim, k_dim = values_NK.shape
    if tiles is None:
        tiles = fitted_tiles(lookup(tuned.W8A8_MOSAIC_WS, dtype=x_MK.dtype), x_MK.shape[0], n_dim)
    else:
        tiles = _whole_groups(tiles, n_dim)
    if interpret:
        raise ValueError("w8a8_linear_ws_mgpu runs on a GPU only (the Mosaic GPU interpreter lacks its pipeline)")
    if not fits(values_NK, block, tiles.block_n):
        raise ValueError(
            f"w8a8_linear_ws_mgpu takes 128 x 128 weight blocks, N a multiple of block_n ({tiles.block_n}, which "
            f"divides 128 or is a multiple of it) and K a multiple of 128; got block {tuple(block)} and a weight of "
            f"{n_dim} x {k_dim}"
        )
    x_q_PK, row_scales_GP = quantized_rows(x_MK, BLOCK_M)
    num_tiles = x_q_PK.shape[0] // BLOCK_M
    y_PN = grouped_call(
        jnp.zeros(num_tiles, jnp.int32),
        jnp.arange(num_tiles, dtype=jnp.int32) * BLOCK_M,
        x_q_PK,
        row_scales_GP,
        (_OneExpert(values_NK[None], scales[None]),),
        out_type=jax.ShapeDtypeStruct((x_q_PK.shape[0], n_dim), x_MK.dtype),
        block_n=tiles.block_n,
        columns=tiles.columns,
        stages=tiles.stages,
        store=store_rows,
        name="w8a8_linear_ws_mgpu",
        tma_dtype=x_MK.dtype if tiles.tma_store else None,
        step_blocks=math.gcd(tiles.step_blocks, k_dim // BLOCK_K),
    )
    return y_PN[: x_MK.shape[0]]
