"""The persistent, warp-specialised Mosaic GPU W8A8 linear (`pallas_kernels.fp8.gpu_mosaic_ws`) against float64
numpy written from the W8A8 formula (test_fp8_linear's): the wrapper around the grouped kernel with a jnp stand-in
for it, CUDA lowering, the default choice by K, the compiled kernel on a GPU (jax 0.10's Mosaic GPU interpreter cannot
run it)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from helpers import gpu_test, lower_for_cuda, rel_error
from test_fp8_linear import MOSAIC_WEIGHT, mosaic_case
from test_moe_w8a8_mosaic import stand_in_call

from ling_jax.quantized import BlockFP8Weight
from pallas_kernels.fp8 import fp8_linear, gpu_mosaic_ws, tuned
from pallas_kernels.fp8.ops import MOSAIC_WS, W8A8
from pallas_kernels.tuning import lookup


def test_tuned_tiles_fit_the_product():
    """The 16-bit default's 256-column tiles where they divide N and fill the SMs (FALLBACK_CORES on a CPU); 128
    columns for a 384-wide weight, for the joined gate halves (256 wide: 64 items of 8192 rows) and for fp32
    outputs; one column tile an item where column groups would leave SMs idle."""
    default = lookup(tuned.W8A8_MOSAIC_WS, dtype=jnp.bfloat16)
    assert (default.block_n, default.tma_store) == (256, True)
    fitted = functools.partial(gpu_mosaic_ws.fitted_tiles, default)
    assert (fitted(8192, 4096).block_n, fitted(8192, 4096).columns) == (256, 2)
    assert (fitted(8192, 384).block_n, fitted(8192, 384).columns) == (128, 1)  # 3 column tiles: no group of 2
    assert (fitted(8192, 768).block_n, fitted(8192, 768).columns) == (256, 1)
    assert (fitted(8192, 256).block_n, fitted(8192, 256).columns) == (128, 1)
    assert (fitted(2048, 4096).block_n, fitted(2048, 4096).columns) == (256, 1)  # 16 x 16 items
    assert lookup(tuned.W8A8_MOSAIC_WS, dtype=jnp.float32).block_n == 128


def test_warp_specialised_w8a8_wraps_the_grouped_kernel_as_one_expert(monkeypatch):
    """The dense product as the experts' kernel with one expert (rows padded to whole 128-row tiles, cut back),
    the kernel a jnp stand-in; it lowers for CUDA at Ling-3.0-flash's q projection over 8192 rows, and refuses
    other blocks and the interpreter."""
    monkeypatch.setattr(gpu_mosaic_ws, "grouped_call", stand_in_call)
    weight, x, expected = mosaic_case(131, jnp.float32, seed=4)
    with jax.disable_jit():  # the stand-in walks the tiles in Python
        y = gpu_mosaic_ws.w8a8_linear_ws_mgpu(x, weight.values, weight.scales, block=weight.block)
    assert y.shape == (131, MOSAIC_WEIGHT[0]) and rel_error(y, expected) <= 1e-4
    monkeypatch.undo()
    shape = jax.ShapeDtypeStruct
    lowered = lower_for_cuda(
        lambda x, w: fp8_linear(x, w, backend="pallas_gpu", mode=W8A8, variant=MOSAIC_WS),
        shape((8192, 2560), jnp.bfloat16),
        BlockFP8Weight(shape((4096, 2560), jnp.float8_e4m3fn), shape((32, 20), jnp.float32), (128, 128)),
    )
    assert "w8a8_linear_ws_mgpu" in lowered.as_text()
    odd = BlockFP8Weight(weight.values, weight.scales, (128, 64))
    with pytest.raises(ValueError, match="w8a8_linear_ws_mgpu takes 128 x 128 weight blocks"):
        gpu_mosaic_ws.w8a8_linear_ws_mgpu(x, odd.values, odd.scales, block=odd.block)
    with pytest.raises(ValueError, match="runs on a GPU only"):
        gpu_mosaic_ws.w8a8_linear_ws_mgpu(x, weight.values, weight.scales, block=weight.block, interpret=True)


def compiled_tiles(dtype) -> tuple:
    """The tile settings the GPU test compiles: 64-, 128- and 256-column tiles (the last two weight blocks wide), one
    or two an item; the outputs written from registers and by TMA through shared memory; one K block a pipeline
    step and three; for 16-bit outputs the default's 256-column TMA-stored tiles unfitted."""
    return (
        None,
        tuned.WarpSpecialisedTiles(64, 3, 2),
        tuned.WarpSpecialisedTiles(128, 4, 2, tma_store=True),
        tuned.WarpSpecialisedTiles(64, 3, 2, tma_store=True),
        tuned.WarpSpecialisedTiles(256, 3, 2),
        tuned.WarpSpecialisedTiles(256, 2, 1, tma_store=True),  # 3 stages of it exceed shared memory in fp32
        tuned.WarpSpecialisedTiles(128, 3, 2, step_blocks=2),  # K = 384: 3 blocks, one a step
        # three blocks a step: 64 columns (128 with a TMA store exceed shared memory, in bf16 by 32 bytes)
        tuned.WarpSpecialisedTiles(64, 3, 2, tma_store=True, step_blocks=3),
        # the 16-bit default at full size (the small products here fit it to 128 columns)
        *((tuned.WarpSpecialisedTiles(256, 3, 2, tma_store=True),) if dtype == jnp.bfloat16 else ()),
    )


def test_compiled_tiles_fit_shared_memory():
    """Every setting of the GPU test below lowers for CUDA at its shape (300 rows, 512 x 384) in fp32 and bf16: the
    lowering refuses a kernel past an SM's 227 KiB of shared memory, which the GPU would only tell on the device."""
    shape = jax.ShapeDtypeStruct
    weight = (shape((2 * MOSAIC_WEIGHT[0], MOSAIC_WEIGHT[1]), jnp.float8_e4m3fn), shape((4, 3), jnp.float32))
    for dtype in (jnp.float32, jnp.bfloat16):
        for tiles in compiled_tiles(dtype):
            lower_for_cuda(
                functools.partial(gpu_mosaic_ws.w8a8_linear_ws_mgpu, block=(128, 128), tiles=tiles),
                shape((300, MOSAIC_WEIGHT[1]), dtype),
                *weight,
            )


@gpu_test("the compiled warp-specialised Mosaic GPU W8A8 kernel")
@pytest.mark.parametrize("dtype, rows", [(jnp.float32, 131), (jnp.bfloat16, 64), (jnp.bfloat16, 300)])
def test_compiled_warp_specialised_w8a8_matches_float64(dtype, rows):
    """x quantised per token, FP8 products, at every setting of `compiled_tiles`; a partial row tile, one tile,
    three."""
    out_dim = 2 * MOSAIC_WEIGHT[0]
    weight, x, expected = mosaic_case(rows, dtype, seed=rows, shape=(out_dim, MOSAIC_WEIGHT[1]))
    for tiles in compiled_tiles(dtype):
        y = gpu_mosaic_ws.w8a8_linear_ws_mgpu(x, weight.values, weight.scales, block=weight.block, tiles=tiles)
        assert y.dtype == dtype and y.shape == (rows, out_dim) and bool(jnp.all(jnp.isfinite(y)))
        assert rel_error(y, expected) <= (1e-2 if dtype == jnp.bfloat16 else 1e-3), tiles


def test_default_w8a8_kernel_by_k():
    """From tuned.MOSAIC_WS_MIN_K inputs and MOSAIC_WS_MIN_ROWS rows the warp-specialised kernel, below either
    gpu_mosaic (4096 outputs)."""
    shape = jax.ShapeDtypeStruct
    least, fewer = (tuned.MOSAIC_WS_MIN_ROWS, tuned.MOSAIC_WS_MIN_K), (tuned.MOSAIC_WS_MIN_ROWS - 64, 4096)
    for (rows, k_dim), name in (
        (least, "w8a8_linear_ws_mgpu"),
        ((least[0], least[1] - 128), "w8a8_linear_mgpu"),
        (fewer, "w8a8_linear_mgpu"),
    ):
        weight = BlockFP8Weight(
            shape((4096, k_dim), jnp.float8_e4m3fn), shape((32, k_dim // 128), jnp.float32), (128, 128)
        )
        text = lower_for_cuda(
            lambda x, w: fp8_linear(x, w, backend="pallas_gpu", mode=W8A8), shape((rows, k_dim), jnp.bfloat16), weight
        ).as_text()
        assert name in text and ("w8a8_linear_ws_mgpu" in text) == (name == "w8a8_linear_ws_mgpu"), (rows, k_dim)
