"""The weight-only block-FP8 linear map on TPU (`pallas_kernels.fp8.tpu_mosaic`) in Pallas interpret mode against
float64 numpy written from spec §6.2, the in-kernel decoders against ml_dtypes, the TPU dispatch of `fp8_linear`,
and lowering for TPU v5e / v6e from the CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import rel_error
from jax.experimental.pallas import tpu as pltpu
from tpu_lowering import TPU_KINDS, abstract_tpu, calls_a_kernel, lower_for_tpu

from ling_jax.layers import project
from ling_jax.policy import ExecutionPolicy
from ling_jax.quantized import BlockFP8Weight
from pallas_kernels import tpu_dequant
from pallas_kernels.fp8 import fp8_linear
from pallas_kernels.fp8.ops import W8A8, WEIGHT_ONLY, default_mode, kernel
from pallas_kernels.fp8.tpu_mosaic import takes
from pallas_kernels.fp8.tuned import TpuTiles

TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}
DTYPES = pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
tpu_linear = kernel("weight_only_linear", "tpu_mosaic")


def random_weight(out_dim: int, in_dim: int, block=(128, 128), seed: int = 0) -> BlockFP8Weight:
    r = np.random.default_rng(seed)
    values = np.asarray(r.normal(size=(out_dim, in_dim)) * 60.0, ml_dtypes.float8_e4m3fn)
    scales = r.uniform(1e-3, 1e-2, (-(-out_dim // block[0]), -(-in_dim // block[1]))).astype(np.float32)
    return BlockFP8Weight(jnp.asarray(values), jnp.asarray(scales), block)


def float64_weight(weight: BlockFP8Weight) -> np.ndarray:
    """W[o, i] = values[o, i] * scales[o // br, i // bc], every edge block partial (spec §6.2)."""
    out_dim, in_dim = weight.shape
    rows, cols = weight.block
    scales = np.asarray(weight.scales, np.float64)
    full = np.repeat(np.repeat(scales, rows, 0), cols, 1)[:out_dim, :in_dim]
    return np.asarray(weight.values).astype(np.float64) * full


def random_x(rows: int, in_dim: int, dtype, seed: int = 1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(rows, in_dim)), dtype)


@pytest.mark.parametrize("rows", [1, 7, 130])
@DTYPES
def test_kernel_matches_float64(rows, dtype):
    """300 outputs (3 row blocks, the last partial, over 2 output tiles), 200 inputs (a partial K block):
    a decode-shaped call (1 row), a few rows and a partial second row tile (130 rows, 128-row tiles)."""
    weight, x = random_weight(300, 200, seed=rows), random_x(rows, 200, dtype, seed=rows + 1)
    y = tpu_linear(x, weight.values, weight.scales, block=weight.block, tiles=TpuTiles(128, 256), interpret=True)
    assert y.dtype == dtype and y.shape == (rows, 300)
    expected = np.asarray(x.astype(jnp.float32), np.float64) @ float64_weight(weight).T
    assert rel_error(y.astype(jnp.float32), expected) <= TOLERANCE[dtype]


def test_one_by_32_blocks_and_narrow_output_tiles():
    """The converter's 1 x 32 FP8 blocks (a select per group in a 128-input chunk), 8-row output tiles."""
    weight, x = random_weight(40, 200, block=(1, 32)), random_x(3, 200, jnp.float32)
    y = tpu_linear(x, weight.values, weight.scales, block=weight.block, tiles=TpuTiles(256, 8), interpret=True)
    assert rel_error(y, np.asarray(x, np.float64) @ float64_weight(weight).T) <= 1e-4


def test_fp8_and_e2m1_decoding_is_exact():
    """Every e4m3 byte (but the two NaNs) decodes to its value through the TPU's b11 FP8 type and the scales' 16,
    -0 (0x80, the b11 type's NaN) to 0; every E2M1 nibble to its value; E8M0 codes u to 2^(u - 127)."""
    codes = np.arange(256, dtype=np.uint8)
    expected = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    stored = tpu_dequant.block_fp8(jnp.asarray(expected, jnp.float8_e4m3fn)[None], jnp.ones((1, 1)), (1, 256))
    (decoded,) = tpu_dequant._decode(stored.values, stored.fmt)
    decoded = np.asarray(decoded[0], np.float64) * np.asarray(stored.scales)[0, 0]
    number = ~np.isnan(expected)
    np.testing.assert_array_equal(decoded[number], expected[number])
    assert decoded[0x80] == 0
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])  # spec §6.3
    np.testing.assert_array_equal(np.asarray(tpu_dequant._e2m1_to_f32(jnp.arange(16, dtype=jnp.int32))), e2m1)
    exponents = np.arange(1, 255, dtype=np.uint8)
    scales = np.asarray(tpu_dequant._scale_values(jnp.asarray(exponents)), np.float64)
    np.testing.assert_array_equal(scales, 2.0 ** (exponents.astype(np.float64) - 127))


def test_tpu_backends_run_the_kernel_weight_only():
    """On a TPU backend fp8_linear is weight-only at every row count and runs the kernel unnamed; W8A8, which
    a TPU has no FP8 unit for, runs the reference; differentiable in x like dequantise-then-dot."""
    weight, x = random_weight(150, 200), random_x(5, 200, jnp.float32)
    assert default_mode(1, "interpret_tpu") == default_mode(4096, "pallas_tpu") == WEIGHT_ONLY
    on = lambda backend, **mode: lambda x: fp8_linear(x, weight, backend=backend, **mode)
    assert calls_a_kernel(on("interpret_tpu"), x) and calls_a_kernel(on("interpret_tpu"), x.astype(jnp.bfloat16))
    assert not calls_a_kernel(on("interpret_tpu", mode=W8A8), x) and not calls_a_kernel(on("reference"), x)
    assert calls_a_kernel(
        lambda x: project(x, weight, ExecutionPolicy(kernel_backend="interpret_tpu")), x
    )  # the model's linear layers
    probe = random_x(5, 150, jnp.float32, seed=9)
    loss = lambda backend: lambda x: jnp.sum(probe * on(backend)(x))
    assert rel_error(jax.grad(loss("interpret_tpu"))(x), jax.grad(loss("reference"))(x)) <= 1e-6


def test_scale_blocks_the_kernel_does_not_take_run_the_reference():
    weight, x = random_weight(24, 200, block=(3, 128)), random_x(2, 200, jnp.float32)
    assert not takes(x, weight) and takes(x, random_weight(24, 200, block=(16, 256)))
    reference = fp8_linear(x, weight, backend="reference")
    np.testing.assert_array_equal(fp8_linear(x, weight, backend="interpret_tpu"), reference)
    with pytest.raises(ValueError, match=r"scale blocks \(3, 128\) are not handled"):
        tpu_linear(x, weight.values, weight.scales, block=weight.block, interpret=True)


@pytest.mark.parametrize("chip", sorted(TPU_KINDS))
@pytest.mark.parametrize("rows", [1, 256])
def test_kernel_lowers_for_tpu(chip, rows):
    """A Ling-3.1-flash projection (8192 x 4096, 128 x 128 blocks) at decode and prefill sizes, on v5e / v6e."""
    abstract = (
        jax.ShapeDtypeStruct((rows, 4096), jnp.bfloat16),
        jax.ShapeDtypeStruct((8192, 4096), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((64, 32), jnp.float32),
    )
    with abstract_tpu(TPU_KINDS[chip]):
        assert str(pltpu.get_tpu_info().chip_version) == chip
    lowered = lower_for_tpu(functools.partial(tpu_linear, block=(128, 128)), *abstract, device_kind=TPU_KINDS[chip])
    assert "tpu_custom_call" in lowered.as_text()
