"""The lab's block-FP8 linear variants (`pallas_kernels.experimental`): the XLA scale-folded products and the Mosaic
GPU weight-only kernel, against float64 numpy; named only (importing their modules registers them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import gpu_test, lower_for_cuda, rel_error
from test_fp8_linear import MOSAIC_WEIGHT, f64, float64_weight, random_weight, random_x

from ling_jax.quantized import BlockFP8Weight
from pallas_kernels.experimental.fp8_mosaic_weight_only import MosaicWeightOnlyTiles
from pallas_kernels.experimental.fp8_xla_folded import weight_only_linear_xla, weight_only_linear_xla_reduce
from pallas_kernels.fp8 import fp8_linear
from pallas_kernels.fp8.ops import MOSAIC, WEIGHT_ONLY, kernel
from pallas_kernels.fp8.reference import dequantize_blocks


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_xla_folded_product_matches_float64(dtype, tol):
    """3 rows, 384 outputs over 3 row blocks of 128 with their own scales, 256 inputs over 2 K blocks; a weight
    whose sides are not multiples of the block is refused."""
    weight, x = random_weight(384, 256, seed=9), random_x((3, 256), dtype, seed=10)
    for product in (weight_only_linear_xla, weight_only_linear_xla_reduce):
        y = product(x, weight.values, weight.scales, block=weight.block)
        assert y.dtype == dtype and y.shape == (3, 384)
        assert rel_error(y, f64(x) @ float64_weight(weight).T) <= tol
    odd = random_weight(150, 256)
    with pytest.raises(ValueError, match=r"multiples of its block \(128, 128\), got \[150, 256\]"):
        weight_only_linear_xla(x, odd.values, odd.scales, block=odd.block)


def test_mosaic_weight_only_kernel_lowers_for_cuda_and_refuses_other_inputs():
    """At a decode batch of 64 rows of the 8192 x 4096 projection; fp32 x, more than 128 rows or blocks other than
    128 x 128 are refused with the shapes named."""
    shape = jax.ShapeDtypeStruct
    lowered = lower_for_cuda(
        lambda x, w: fp8_linear(x, w, backend="pallas_gpu", mode=WEIGHT_ONLY, variant=MOSAIC),
        shape((64, 4096), jnp.bfloat16),
        BlockFP8Weight(shape((8192, 4096), jnp.float8_e4m3fn), shape((64, 32), jnp.float32), (128, 128)),
    )
    assert "mosaic_gpu" in lowered.as_text()
    weight = random_weight(*MOSAIC_WEIGHT)
    for x in (random_x((5, MOSAIC_WEIGHT[1]), jnp.float32), random_x((129, MOSAIC_WEIGHT[1]), jnp.bfloat16)):
        with pytest.raises(ValueError, match="weight_only_linear_mgpu takes bf16 / fp16 x of at most 128 rows"):
            fp8_linear(x, weight, backend="pallas_gpu", mode=WEIGHT_ONLY, variant=MOSAIC)


@gpu_test("the compiled Mosaic GPU weight-only kernel")
@pytest.mark.parametrize("rows", [5, 64, 128])
def test_compiled_mosaic_weight_only_kernel_matches_float64(rows):
    """W dequantised to bf16 (the reference's rounding), then the product in float64; 256 outputs (4 CTAs), 384
    inputs (3 K blocks: k_splits 1 and 3)."""
    weight, x = random_weight(*MOSAIC_WEIGHT, seed=rows), random_x((rows, MOSAIC_WEIGHT[1]), jnp.bfloat16, seed=rows)
    w_bf16 = f64(dequantize_blocks(weight.values, weight.scales, weight.block, jnp.bfloat16))
    mosaic = kernel("weight_only_linear", MOSAIC)
    for k_splits in (1, 3):
        y = mosaic(x, weight.values, weight.scales, block=weight.block, tiles=MosaicWeightOnlyTiles(4, k_splits))
        assert y.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(y)))
        assert rel_error(y, f64(x) @ w_bf16.T) <= 1e-2, k_splits
