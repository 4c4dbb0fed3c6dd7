"""The TPU grouped matmul with block-FP8, MXFP4 or dense expert stacks (`pallas_kernels.moe.tpu_mosaic`) in Pallas
interpret mode against float64 numpy written from spec §6.2 / §6.3, its visit schedule, the TPU dispatch of
`grouped_matmul`, and lowering for TPU v5e / v6e from the CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import rel_error
from tpu_lowering import TPU_KINDS, calls_a_kernel, lower_for_tpu

from ling_jax.policy import ExecutionPolicy
from ling_jax.quantized import BlockFP8Weight, MXFP4Weight
from pallas_kernels.moe import grouped_matmul
from pallas_kernels.moe.ops import kernel
from pallas_kernels.moe.tpu_mosaic import visit_schedule

TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}
DTYPES = pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])  # spec §6.3
GROUP_SIZES = {1: [0, 1, 0, 0], 7: [2, 0, 4, 0], 130: [40, 0, 70, 15]}  # ragged, an empty group, tail rows
NUM_GROUPS, OUT, IN = 4, 300, 200
tpu_grouped = kernel("grouped_matmul", "tpu_mosaic")


def fp8_stack(block=(128, 128), seed: int = 0) -> BlockFP8Weight:
    r = np.random.default_rng(seed)
    values = np.asarray(r.normal(size=(NUM_GROUPS, OUT, IN)) * 60.0, ml_dtypes.float8_e4m3fn)
    scale_shape = (NUM_GROUPS, -(-OUT // block[0]), -(-IN // block[1]))
    return BlockFP8Weight(jnp.asarray(values), jnp.asarray(r.uniform(1e-3, 1e-2, scale_shape), jnp.float32), block)


def mxfp4_stack(seed: int = 0, e8m0: bool = True) -> MXFP4Weight:
    r = np.random.default_rng(seed)
    packed = jnp.asarray(r.integers(0, 256, (NUM_GROUPS, OUT, IN // 2)), jnp.uint8)
    exponents = r.integers(118, 131, (NUM_GROUPS, OUT, -(-IN // 32))).astype(np.uint8)
    scales = exponents.view(ml_dtypes.float8_e8m0fnu) if e8m0 else 2.0 ** (exponents.astype(np.float32) - 127)
    return MXFP4Weight(packed, jnp.asarray(scales))


def float64_stack(weight) -> np.ndarray:
    """The dense [G, N, K] stack: block FP8 values x scales[n // br, k // bc]; MXFP4 byte j of a row holding
    element 2j (low nibble) and 2j + 1 (high), each E2M1(nibble) x 2^(u - 127) of its 32-input group."""
    if isinstance(weight, BlockFP8Weight):
        rows, cols = weight.block
        scales = np.asarray(weight.scales, np.float64)
        full = np.repeat(np.repeat(scales, rows, 1), cols, 2)[:, :OUT, :IN]
        return np.asarray(weight.values).astype(np.float64) * full
    if isinstance(weight, MXFP4Weight):
        packed = np.asarray(weight.values)
        nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(NUM_GROUPS, OUT, IN)
        scales = np.asarray(weight.scales).astype(np.float64)
        return E2M1[nibbles] * np.repeat(scales, 32, axis=2)[:, :, :IN]
    return np.asarray(weight, np.float64)


def float64_grouped(x, weight, sizes) -> np.ndarray:
    x64, stack = np.asarray(jnp.asarray(x, jnp.float32), np.float64), float64_stack(weight)
    out = np.zeros((x64.shape[0], OUT))
    start = 0
    for group, size in enumerate(sizes):
        out[start : start + size] = x64[start : start + size] @ stack[group].T
        start += size
    return out


def random_x(rows: int, dtype, seed: int = 1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(rows, IN)), dtype)


def check(weight, rows: int, dtype, **tiles):
    sizes = GROUP_SIZES[rows]
    x = random_x(rows, dtype, seed=rows)
    y = tpu_grouped(x, weight, jnp.asarray(sizes, jnp.int32), interpret=True, **tiles)
    assert y.dtype == dtype and y.shape == (rows, OUT)
    y = np.asarray(y.astype(jnp.float32))
    assert rel_error(y, float64_grouped(x, weight, sizes)) <= TOLERANCE[dtype]
    assert not y[sum(sizes) :].any()  # the rows past the groups are zeros


@pytest.mark.parametrize("rows", sorted(GROUP_SIZES))
@DTYPES
def test_block_fp8_experts_match_float64(rows, dtype):
    check(fp8_stack(seed=rows), rows, dtype)


@pytest.mark.parametrize("rows", sorted(GROUP_SIZES))
@DTYPES
def test_mxfp4_experts_match_float64(rows, dtype):
    check(mxfp4_stack(seed=rows), rows, dtype)


@pytest.mark.parametrize(
    "weight",
    [
        lambda: mxfp4_stack(e8m0=False),
        lambda: fp8_stack(block=(1, 32)),
        lambda: jnp.asarray(np.random.default_rng(2).normal(size=(NUM_GROUPS, OUT, IN)), jnp.float32),
    ],
    ids=["mxfp4_float_scales", "fp8_1x32", "dense"],
)
def test_other_stored_forms_match_float64(weight):
    """MXFP4 scales stored as fp32 powers of two, the converter's 1 x 32 FP8 experts, a dense stack; 8-row
    tiles, so that groups span tiles and tiles are shared."""
    check(weight(), 130, jnp.float32, block_m=8)


def test_visit_schedule_matches_a_loop():
    """Every (group, row tile) pair in row order, then one zero-filling visit per row tile past the groups."""
    r = np.random.default_rng(3)
    schedule_of = jax.jit(visit_schedule, static_argnums=(1, 2))
    for num_rows, block_m in ((37, 8), (64, 16), (5, 8)):
        sizes = r.multinomial(num_rows - r.integers(0, 4), r.dirichlet(np.ones(6)) * (r.uniform(size=6) > 0.3 + 1e-9))
        schedule, num_visits = schedule_of(jnp.asarray(sizes, jnp.int32), num_rows, block_m)
        got = np.stack([np.asarray(a)[: int(num_visits)] for a in schedule], axis=1)
        expected, start = [], 0
        for group, size in enumerate(sizes):
            tiles = range(start // block_m, (start + size - 1) // block_m + 1) if size else ()
            expected += [(group, tile, tile, start, start + size) for tile in tiles]
            start += size
        last = max([g for g, s in enumerate(sizes) if s], default=0)
        used = -(-start // block_m)
        expected += [(last, max(used - 1, 0), tile, start, start) for tile in range(used, -(-num_rows // block_m))]
        np.testing.assert_array_equal(got, np.array(expected).reshape(-1, 5))
        assert len(schedule[0]) == -(-num_rows // block_m) + len(sizes) - 1


def test_tpu_backends_run_the_kernel_for_quantized_stacks():
    """Unnamed on a TPU backend: the kernel for a quantised stack, XLA's ragged dot for a dense one; the
    reference dequantises; the kernel's gradient in lhs is the reference's."""
    weight, x = mxfp4_stack(), random_x(7, jnp.float32)
    sizes = jnp.asarray(GROUP_SIZES[7], jnp.int32)
    on = lambda backend, rhs: lambda x: grouped_matmul(x, rhs, sizes, backend=backend)
    assert calls_a_kernel(on("interpret_tpu", weight), x) and not calls_a_kernel(on("reference", weight), x)
    assert not calls_a_kernel(on("interpret_tpu", weight.dequantize(jnp.float32)), x)
    assert rel_error(on("reference", weight)(x), float64_grouped(x, weight, GROUP_SIZES[7])) <= 1e-5
    probe = random_x(7, jnp.float32, seed=9)[:, :1] * jnp.linspace(-1.0, 1.0, OUT)
    loss = lambda backend: lambda x: jnp.sum(probe * on(backend, weight)(x))
    assert rel_error(jax.grad(loss("interpret_tpu"))(x), jax.grad(loss("reference"))(x)) <= 1e-6


def test_a_stack_the_kernel_does_not_take_is_refused():
    with pytest.raises(ValueError, match="weight.values: expected float8_e4m3fn"):
        tpu_grouped(random_x(2, jnp.float32), MXFP4Weight(jnp.zeros((1, 8, 100), jnp.int8), jnp.ones((1, 8, 7))), None)


def _abstract_stacks(num_groups: int, out_dim: int, in_dim: int) -> dict:
    s = jax.ShapeDtypeStruct
    return {
        "fp8": BlockFP8Weight(
            s((num_groups, out_dim, in_dim), jnp.float8_e4m3fn),
            s((num_groups, out_dim // 128, in_dim // 128), jnp.float32),
            (128, 128),
        ),
        "mxfp4": MXFP4Weight(
            s((num_groups, out_dim, in_dim // 2), jnp.uint8), s((num_groups, out_dim, in_dim // 32), jnp.float8_e8m0fnu)
        ),
    }


@pytest.mark.parametrize("chip", sorted(TPU_KINDS))
@pytest.mark.parametrize("stack", ["fp8", "mxfp4"])
@pytest.mark.parametrize("rows", [64, 2048])
def test_kernel_lowers_for_tpu(chip, stack, rows):
    """Ling-3.1-flash gate/up experts (1280 x 4096; 16 of the 512 experts, enough for the lowering), at decode
    (8 tokens x top-8) and prefill sizes, on v5e / v6e."""
    weight = _abstract_stacks(16, 1280, 4096)[stack]
    abstract = (jax.ShapeDtypeStruct((rows, 4096), jnp.bfloat16), weight, jax.ShapeDtypeStruct((16,), jnp.int32))
    lowered = lower_for_tpu(tpu_grouped, *abstract, device_kind=TPU_KINDS[chip])
    assert "tpu_custom_call" in lowered.as_text()


def test_the_moe_layer_reaches_the_kernel_with_stored_experts():
    """`local_moe` on a TPU backend hands quantised experts to the grouped kernel as stored (no dense stack first),
    and equals the reference backend, which dequantises the layer."""
    from ling_jax.moe.experts import local_moe
    from pallas_kernels.moe.ops import ExpertWeights, Routing

    tokens, top_k = 5, 2
    gate, up = fp8_stack(seed=3), fp8_stack(seed=4)
    down = BlockFP8Weight(
        jnp.swapaxes(fp8_stack(seed=5).values, 1, 2), jnp.swapaxes(fp8_stack(seed=5).scales, 1, 2), (128, 128)
    )
    r = np.random.default_rng(6)
    x = random_x(tokens, jnp.float32, seed=7)
    experts = jnp.asarray(r.choice(NUM_GROUPS, (tokens, top_k)), jnp.int32)
    weights = jnp.asarray(r.uniform(0.1, 1.0, (tokens, top_k)), jnp.float32)
    routing, stacks = Routing(weights, experts), ExpertWeights(gate, up, down)

    def on(backend):
        return lambda x: local_moe(x, routing, stacks, 7.0, policy=ExecutionPolicy(kernel_backend=backend))

    assert calls_a_kernel(on("interpret_tpu"), x) and not calls_a_kernel(on("reference"), x)
    assert rel_error(on("interpret_tpu")(x), on("reference")(x)) <= 1e-5
