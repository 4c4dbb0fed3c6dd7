"""Block-FP8 linear maps (`pallas_kernels.fp8`): the GPU kernels (Pallas interpret mode on the CPU, compiled on
the device machine) against float64 numpy written from spec §6.2 and the W8A8 formula; the dispatch; gradients;
lowering for CUDA."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import gpu_test, lower_for_cuda, rel_error

from benchmarks.kernel_census import kernel_census
from ling_jax.quantized import BlockFP8Weight
from pallas_kernels.fp8 import GatedHeadNorm, fp8_linear
from pallas_kernels.fp8.gpu_triton import weight_only_gemv_many_gpu, weight_only_gemv_partials_gpu
from pallas_kernels.fp8.ops import (
    GEMV,
    MOSAIC,
    TC_ACC,
    W8A8,
    WEIGHT_ONLY,
    default_mode,
    fp8_linear_many,
    fp8_linear_partials,
    kernel,
    kernel_takes,
)
from pallas_kernels.fp8.reference import gated_head_norm, weight_only_linear_reference
from pallas_kernels.fp8.tuned import (
    GEMV_DEFAULT_ROWS,
    GEMV_DOT_ROWS,
    GEMV_MAX_ROWS,
    MOSAIC_MIN_ROWS,
    SUM_AFTER_LOOP,
    SUM_EACH_BLOCK,
    W8A8_MIN_ROWS,
    WEIGHT_ONLY_GEMV,
    WEIGHT_ONLY_MAX_ROWS,
    GemvTiles,
    MosaicTiles,
    gemv_bucket,
    gemv_by_default,
    weight_only_bucket,
)
from pallas_kernels.fp8.tuned import W8A8 as W8A8_TILES
from pallas_kernels.fp8.tuned import W8A8_TC_ACC as W8A8_TC_ACC_TILES
from pallas_kernels.fp8.tuned import WEIGHT_ONLY as WEIGHT_ONLY_TILES
from pallas_kernels.tuning import H200, lookup

E4M3 = ml_dtypes.float8_e4m3fn


def random_weight(out_dim: int, in_dim: int, block=(128, 128), seed: int = 0) -> BlockFP8Weight:
    r = np.random.default_rng(seed)
    values = np.asarray(r.normal(size=(out_dim, in_dim)) * 60.0, E4M3)
    scales = r.uniform(1e-3, 1e-2, (-(-out_dim // block[0]), -(-in_dim // block[1]))).astype(np.float32)
    return BlockFP8Weight(jnp.asarray(values), jnp.asarray(scales), block)


def random_x(shape, dtype, seed: int = 1):
    r = np.random.default_rng(seed)
    return jnp.asarray(r.normal(size=shape) * r.uniform(0.1, 10.0, shape[-1]), dtype)  # uneven group ranges


def f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def float64_weight(weight: BlockFP8Weight) -> np.ndarray:
    """W[o, i] = values[o, i] * scales[o // br, i // bc] (spec §6.2)."""
    out_dim, in_dim = weight.shape
    rows, cols = weight.block
    full = np.repeat(np.repeat(f64(weight.scales), rows, 0), cols, 1)[:out_dim, :in_dim]
    return f64(weight.values) * full


def float64_quantized_x(x_MK: np.ndarray, group: int) -> np.ndarray:
    """x dequantised after per-token 1 x group quantisation: scale = max(amax, 1e-10) / 448 over each group,
    x_q = e4m3(clip(x / scale, +-448)) rounded to nearest even."""
    dequantized = np.empty_like(x_MK)
    for start in range(0, x_MK.shape[1], group):
        part = x_MK[:, start : start + group]
        scale = np.maximum(np.abs(part).max(axis=1, keepdims=True), 1e-10) / 448.0
        codes = np.clip(part / scale, -448.0, 448.0).astype(E4M3).astype(np.float64)
        dequantized[:, start : start + group] = codes * scale
    return dequantized


@pytest.mark.parametrize("rows", [5, 37, 70])
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_weight_only_kernel_matches_float64(dtype, tol, rows):
    """Odd sizes: 5 rows (the "few_rows" tiles), 37 ("more_rows") or 70 ("many_rows"), 150 outputs over 2 partial
    row blocks, 200 inputs over 2 partial K blocks; the products with the weight tile on either side."""
    weight, x = random_weight(150, 200), random_x((rows, 200), dtype)
    expected = f64(x) @ float64_weight(weight).T
    y = fp8_linear(x, weight, backend="interpret_gpu", mode=WEIGHT_ONLY, variant="gpu_triton")
    assert y.dtype == dtype and y.shape == (rows, 150)
    assert rel_error(y, expected) <= tol
    weight_only = kernel("weight_only_linear", "gpu_triton")
    tiles = lookup(WEIGHT_ONLY_TILES, dtype=dtype, bucket=weight_only_bucket(rows))
    for weight_left in (False, True):
        tiles = dataclasses.replace(tiles, weight_left=weight_left)
        y = weight_only(x, weight.values, weight.scales, block=weight.block, tiles=tiles, interpret=True)
        assert rel_error(y, expected) <= tol, weight_left


def test_gemv_row_buckets_keep_the_measured_one_row_tiles():
    """1 row takes the tiles timed in the model (2 K blocks a step, summed after the loop,
    docs/benchmarks/generation.md); 2 to GEMV_DOT_ROWS - 1 rows (FMA products over several rows) 4 K blocks a step,
    summed after each K block, whose registers fit 4 programs an SM; the tensor-core rows strips of 64 outputs, one K
    block a step, in a 3-stage pipeline. The gemv runs by default at 1-2 rows and, for 16-bit x, at 8 (else the
    block-scaled kernel)."""
    buckets = {rows: gemv_bucket(rows) for rows in (1, 2, GEMV_DOT_ROWS - 1, GEMV_DOT_ROWS, GEMV_MAX_ROWS)}
    assert buckets == {1: "one_row", 2: "fma_rows", 7: "fma_rows", 8: "dot_rows", 16: "dot_rows"}
    tiles = {rows: lookup(WEIGHT_ONLY_GEMV, dtype=jnp.bfloat16, bucket=b, device=H200) for rows, b in buckets.items()}
    assert tiles[1] == GemvTiles(32, 2, 528, GEMV_DOT_ROWS, 4, 2, sum_k=SUM_AFTER_LOOP)
    assert tiles[2] == GemvTiles(32, 4, 528, GEMV_DOT_ROWS, 4, 2, sum_k=SUM_EACH_BLOCK)
    dot_tiles = GemvTiles(64, 1, 528, GEMV_DOT_ROWS, 4, 3, sum_k=SUM_AFTER_LOOP)
    assert tiles[GEMV_DOT_ROWS] == tiles[GEMV_MAX_ROWS] == dot_tiles
    assert all(t.dot_min_rows == GEMV_DOT_ROWS for t in tiles.values())
    assert [rows for rows in range(1, GEMV_MAX_ROWS + 1) if gemv_by_default(rows, jnp.bfloat16)] == [1, 2, 8]
    assert [rows for rows in range(1, GEMV_MAX_ROWS + 1) if gemv_by_default(rows, jnp.float32)] == [1, 2]


def test_weight_only_row_buckets_and_their_h200_tiles():
    """The buckets' edges, and which side of the MMA the weight tile takes in each (docs/benchmarks/matmul.md,
    'The weight tile on either side of the MMA')."""
    buckets = {rows: weight_only_bucket(rows) for rows in (16, 17, 64, 65, WEIGHT_ONLY_MAX_ROWS)}
    assert buckets == {16: "few_rows", 17: "more_rows", 64: "more_rows", 65: "many_rows", 255: "many_rows"}
    left = {bucket: WEIGHT_ONLY_TILES[H200, bucket, "16bit"].params.weight_left for bucket in set(buckets.values())}
    assert left == {"few_rows": False, "more_rows": True, "many_rows": True}


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_gemv_kernel_matches_float64(dtype, tol, rows):
    """150 outputs (2 partial row blocks), 200 inputs (2 partial K blocks). The default variant (the gemv with its
    row bucket's tiles up to GEMV_DEFAULT_ROWS rows); FMA products in strips of 16 outputs, one K block a step, the
    2 steps split over programs; the same summed after each K block, 2 a step, and once after the loop; dot
    products, 4 K blocks a step (2 past the end)."""
    weight, x = random_weight(150, 200, seed=rows), random_x((rows, 200), dtype, seed=rows + 1)
    expected = f64(x) @ float64_weight(weight).T
    y = fp8_linear(x, weight, backend="interpret_gpu", mode=WEIGHT_ONLY)  # the default variant at few rows
    assert y.dtype == dtype and y.shape == (rows, 150)
    assert rel_error(y, expected) <= tol
    gemv = kernel("weight_only_linear", GEMV)
    fma = dict(block_o=16, blocks_per_step=1, min_programs=64, dot_min_rows=GEMV_MAX_ROWS + 1)
    each_block = dict(fma, blocks_per_step=2, sum_k=SUM_EACH_BLOCK)
    after_loop = dict(fma, blocks_per_step=2, sum_k=SUM_AFTER_LOOP)
    for products in (fma, each_block, after_loop, dict(block_o=32, blocks_per_step=4, dot_min_rows=1)):
        tiles = dataclasses.replace(lookup(WEIGHT_ONLY_GEMV, dtype=dtype, bucket=gemv_bucket(rows)), **products)
        y = gemv(x, weight.values, weight.scales, block=weight.block, tiles=tiles, interpret=True)
        assert rel_error(y, expected) <= tol, products


@pytest.mark.parametrize("rows, products", [(1, "fma"), (5, "dot")])
def test_grouped_gemv_matches_float64_and_the_single_weight_kernel(rows, products):
    """Three weights sharing x (150, 40 and 7 outputs: partial strips, a row block of 16 for the last; 200
    inputs: 2 K steps), one launch. Where the launch splits K as each weight alone does (never; both in 2) each
    output is the single-weight kernel's, bit for bit; where the group's strips alone reach min_programs (14 with
    the FMA tiles, 8 with the dot's) and a weight alone would split, the same sums regrouped, within fp32 rounding."""
    weights = [random_weight(150, 200, seed=1), random_weight(40, 200, seed=2), random_weight(7, 200, (16, 128), 3)]
    x = random_x((rows, 200), jnp.float32, seed=4)
    single, many = kernel("weight_only_linear", GEMV), weight_only_gemv_many_gpu
    base = lookup(WEIGHT_ONLY_GEMV, dtype=jnp.float32)
    shape = dict(block_o=16 if products == "fma" else 32, blocks_per_step=1)
    shape["dot_min_rows"] = GEMV_MAX_ROWS + 1 if products == "fma" else 1
    group_strips = 14 if products == "fma" else 8
    values, scales, blocks = (tuple(getattr(w, name) for w in weights) for name in ("values", "scales", "block"))
    for min_programs in (1, group_strips, 64):
        tiles = dataclasses.replace(base, min_programs=min_programs, **shape)
        ys = many(x, values, scales, blocks=blocks, tiles=tiles, interpret=True)
        for y, weight in zip(ys, weights, strict=True):
            assert y.shape == (rows, weight.shape[0]) and y.dtype == x.dtype
            assert rel_error(y, f64(x) @ float64_weight(weight).T) <= 1e-4
            alone = single(x, weight.values, weight.scales, block=weight.block, tiles=tiles, interpret=True)
            if min_programs == group_strips:
                assert rel_error(y, alone) <= 1e-5
            else:
                np.testing.assert_array_equal(np.asarray(y), np.asarray(alone))
    traced = jax.make_jaxpr(functools.partial(many, blocks=blocks, interpret=True))(x, values, scales)
    assert kernel_census(traced) == {"weight_only_gemv_many": 1}


def test_gemv_partials_sum_to_the_gemv():
    """The unreduced form: fp32 partial sums [splits, 1, 150] (200 inputs, 2 K steps: 1 or 2 splits) whose sum,
    cast to x's dtype, is the gemv's y bit for bit; `fp8_linear_partials` only where fp8_linear runs the gemv."""
    weight, x = random_weight(150, 200, seed=8), random_x((1, 200), jnp.bfloat16, seed=9)
    base = dataclasses.replace(lookup(WEIGHT_ONLY_GEMV, dtype=x.dtype), block_o=16, blocks_per_step=1)
    for min_programs, splits in ((1, 1), (64, 2)):
        tiles = dataclasses.replace(base, min_programs=min_programs)
        args = (x, weight.values, weight.scales)
        partials = weight_only_gemv_partials_gpu(*args, block=weight.block, tiles=tiles, interpret=True)
        assert partials.shape == (splits, 1, 150) and partials.dtype == jnp.float32
        y = kernel("weight_only_linear", GEMV)(*args, block=weight.block, tiles=tiles, interpret=True)
        np.testing.assert_array_equal(np.asarray(jnp.sum(partials, axis=0).astype(x.dtype)), np.asarray(y))
    partials = fp8_linear_partials(x[None], weight, backend="interpret_gpu")
    assert rel_error(jnp.sum(partials, axis=0), f64(x) @ float64_weight(weight).T) <= 1e-2
    assert fp8_linear_partials(x, weight, backend="reference") is None
    x32 = x.astype(jnp.float32)
    grads = [
        jax.grad(lambda x: jnp.sum(jnp.sin(product(x))))(x32)
        for product in (
            lambda x: jnp.sum(fp8_linear_partials(x, weight, backend="interpret_gpu"), axis=0),
            lambda x: fp8_linear(x, weight, backend="reference"),
        )
    ]
    assert rel_error(*grads) <= 1e-5  # differentiated as the product
    assert fp8_linear_partials(jnp.tile(x, (GEMV_DEFAULT_ROWS + 1, 1)), weight, backend="interpret_gpu") is None


def gated_norm_case(rows: int, heads: int, head_dim: int, dtype, seed: int):
    """(x [rows, heads * head_dim], its `GatedHeadNorm`: a gate like x, a norm weight near 1, eps 1e-6)."""
    width = heads * head_dim
    x, gate = random_x((rows, width), dtype, seed=seed), random_x((rows, width), dtype, seed=seed + 1)
    weight_D = 1.0 + 0.1 * random_x((head_dim,), jnp.float32, seed=seed + 2)
    return x, GatedHeadNorm(gate, weight_D.astype(dtype), 1e-6)


@pytest.mark.parametrize("products", ["fma", "dot"])
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_gemv_gated_norm_prologue_matches_reference(dtype, tol, products):
    """The gemv's partial sums with KDA's gated output norm formed as it reads x, against the jnp reference (the
    norm, then the product): 3 rows, 5 heads, 150 outputs, heads of one K block of 32 and of two (each program's
    sum of squares over both), the K steps split over programs, the last step's second block past K (masked)."""
    tiles = GemvTiles(16, 2, 64, 3 if products == "dot" else 4, 4, 2)
    for head_dim in (32, 64):
        x, norm = gated_norm_case(3, 5, head_dim, dtype, seed=head_dim)
        weight = random_weight(150, x.shape[1], block=(32, 32), seed=head_dim + 3)
        args = (x, weight.values, weight.scales)
        partials = weight_only_gemv_partials_gpu(*args, block=weight.block, tiles=tiles, interpret=True, norm=norm)
        assert partials.shape[0] > 1
        want = weight_only_linear_reference(gated_head_norm(x, norm), *args[1:], weight.block)
        assert rel_error(jnp.sum(partials, axis=0), want) <= tol, (head_dim, rel_error(jnp.sum(partials, 0), want))


def test_fp8_linear_partials_with_the_gated_norm():
    """`fp8_linear_partials` with a norm: in the gemv where heads are whole K blocks (the launch named
    weight_only_gemv_gated_norm, no norm outside it), by XLA before the plain gemv where a head is a part of one;
    the same product either way, differentiated as the reference; a gate unlike x is refused."""
    x, norm = gated_norm_case(1, 3, 32, jnp.float32, seed=11)
    x_11K, norm = x[None], dataclasses.replace(norm, gate=norm.gate[None])
    for block, launch in (((32, 32), "weight_only_gemv_gated_norm"), ((32, 64), "weight_only_gemv")):
        weight = random_weight(40, x.shape[1], block=block, seed=12)
        partials = functools.partial(fp8_linear_partials, weight=weight, backend="interpret_gpu")
        want = fp8_linear(gated_head_norm(x_11K, norm), weight, backend="reference")[0]
        assert rel_error(jnp.sum(partials(x_11K, norm=norm), axis=0), want) <= 1e-5
        census = kernel_census(jax.make_jaxpr(lambda x: partials(x, norm=norm))(x_11K))
        assert census == ({launch: 1} if launch != "weight_only_gemv" else {launch: 1, "rsqrt outside kernels": 1})
    grads = [
        jax.grad(lambda x, n: jnp.sum(jnp.sin(product(x, n))), argnums=(0, 1))(x_11K, norm)
        for product in (
            lambda x, n: jnp.sum(fp8_linear_partials(x, weight, backend="interpret_gpu", norm=n), axis=0),
            lambda x, n: fp8_linear(gated_head_norm(x, n), weight, backend="reference"),
        )
    ]
    for ours, theirs in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        assert rel_error(ours, theirs) <= 1e-5
    with pytest.raises(ValueError, match="gate shaped like x"):
        weight_only_gemv_partials_gpu(
            x, weight.values, weight.scales, block=(32, 32), interpret=True, norm=dataclasses.replace(norm, gate=x.T)
        )


def test_grouped_fp8_linear_falls_back_per_weight():
    """`fp8_linear_many` groups only what the grouped kernel takes: decode-sized rows on a GPU backend, weights
    of one K block; otherwise (the reference backend, more rows, a dense weight) each product is `fp8_linear`'s."""
    weights = [random_weight(48, 64, (16, 32), seed=5), random_weight(16, 64, (16, 32), seed=6)]
    for rows, backend, launches in (
        (1, "interpret_gpu", 1),
        (GEMV_DEFAULT_ROWS + 1, "interpret_gpu", 0),
        (1, "reference", 0),
    ):
        x = random_x((rows, 64), jnp.float32, seed=7)
        grouped = jax.make_jaxpr(lambda x: fp8_linear_many(x, weights, backend=backend))(x)
        assert kernel_census(grouped)["weight_only_gemv_many"] == launches
        for y, weight in zip(fp8_linear_many(x, weights, backend=backend), weights, strict=True):
            assert rel_error(y, fp8_linear(x, weight, backend=backend)) <= 1e-6


def test_narrow_w8a8_products_join():
    """`fp8_linear_many` in W8A8 on a GPU backend runs the narrow products of one block and K as one product (KDA's
    f_a / g_a): two of 32 and 48 outputs join (3 kernels for 4 weights), one wider than JOIN_MAX_OUTPUTS and one of
    another K block run alone; each output as its product alone (per-column arithmetic, scales kept by row block)."""
    weights = [
        random_weight(32, 64, (16, 32), seed=8),
        random_weight(300, 64, (16, 32), seed=9),
        random_weight(48, 64, (16, 32), seed=10),
        random_weight(32, 64, (16, 64), seed=11),
    ]
    x = random_x((37, 64), jnp.float32, seed=12)
    many = functools.partial(fp8_linear_many, weights=weights, backend="interpret_gpu", mode="w8a8")
    assert sum(kernel_census(jax.make_jaxpr(lambda x: many(x))(x)).values()) == 3
    for y, weight in zip(many(x), weights, strict=True):
        assert y.shape == (37, weight.values.shape[0])
        assert rel_error(y, fp8_linear(x, weight, backend="interpret_gpu", mode="w8a8")) <= 1e-6


@pytest.mark.parametrize("variant", ["gpu_triton", TC_ACC])
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-3), (jnp.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_w8a8_kernel_matches_float64(dtype, tol, variant):
    """37 rows over 3 row tiles of 16 in groups of 2 (the last group partial), 200 outputs in tiles of 64, 300
    inputs; within a few % of the unquantised-activation product. Both variants of the kernel."""
    weight, x = random_weight(200, 300, seed=2), random_x((37, 300), dtype, seed=3)
    w8a8 = kernel("w8a8_linear", variant)
    table = {"gpu_triton": W8A8_TILES, TC_ACC: W8A8_TC_ACC_TILES}[variant]
    tiles = dataclasses.replace(lookup(table, dtype=dtype), block_m=16, block_n=64, group_m=2)
    y = w8a8(x, weight.values, weight.scales, block=weight.block, tiles=tiles, interpret=True)
    assert y.dtype == dtype and y.shape == (37, 200)
    w_NK = float64_weight(weight)
    assert rel_error(y, float64_quantized_x(f64(x), 128) @ w_NK.T) <= tol
    assert rel_error(y, f64(x) @ w_NK.T) <= 0.05


def test_dispatch_by_rows_and_weight():
    assert default_mode(WEIGHT_ONLY_MAX_ROWS, "pallas_gpu") == WEIGHT_ONLY
    assert W8A8_MIN_ROWS == WEIGHT_ONLY_MAX_ROWS + 1  # prefill-sized products: the checkpoint's W8A8
    assert default_mode(W8A8_MIN_ROWS, "pallas_gpu") == W8A8
    assert default_mode(1, "reference") is None
    x = random_x((2, 3, 64), jnp.float32)
    assert kernel_takes(x, random_weight(32, 64, (32, 32)))
    assert not kernel_takes(x, random_weight(32, 64, (1, 32)))  # MXFP4 experts kept as E4M3 + 1 x 32 scales
    assert not kernel_takes(x.astype(jnp.float8_e4m3fn), random_weight(32, 64, (32, 32)))
    with pytest.raises(ValueError, match="mode must be one of"):
        fp8_linear(x, random_weight(32, 64, (32, 32)), mode="w4a8")


def test_reference_backend_is_dequantise_then_dot_over_leading_axes():
    weight, x = random_weight(40, 64, (1, 32), seed=4), random_x((2, 3, 64), jnp.float32, seed=5)
    y = fp8_linear(x, weight, backend="interpret_gpu")  # a 1 x 32 block: no kernel, the reference
    assert y.shape == (2, 3, 40)
    assert rel_error(y, f64(x) @ float64_weight(weight).T) <= 1e-6


def test_gradient_is_dequantise_then_dot():
    weight, x = random_weight(32, 64, (32, 32), seed=6), random_x((3, 64), jnp.float32, seed=7)
    cotangent = random_x((3, 32), jnp.float32, seed=8)
    loss = lambda x: jnp.sum(fp8_linear(x, weight, backend="interpret_gpu", mode=W8A8) * cotangent)  # noqa: E731
    grad = jax.jit(jax.grad(loss))(x)
    assert rel_error(grad, f64(cotangent) @ float64_weight(weight)) <= 1e-5


def test_kernels_lower_for_cuda():
    """Each kernel: the decode-shaped one by default up to GEMV_DEFAULT_ROWS rows (FMA products) and by name at
    GEMV_MAX_ROWS (tensor-core products), the block-scaled ones by default for more rows."""
    weight = random_weight(576, 1000)
    for mode, rows, variant, name in (
        (WEIGHT_ONLY, GEMV_DEFAULT_ROWS, None, "weight_only_gemv"),
        (WEIGHT_ONLY, GEMV_MAX_ROWS, GEMV, "weight_only_gemv"),
        (WEIGHT_ONLY, GEMV_DEFAULT_ROWS + 1, None, "weight_only_linear"),
        (W8A8, 300, None, "w8a8_linear"),  # 576 rows: no Mosaic kernel, the Triton one
        (W8A8, 300, "gpu_triton", "w8a8_linear"),
        (None, WEIGHT_ONLY_MAX_ROWS, None, "weight_only_linear"),  # no mode named: the weight-only kernels
        (None, W8A8_MIN_ROWS, None, "w8a8_linear"),  # then W8A8
        (WEIGHT_ONLY, WEIGHT_ONLY_MAX_ROWS + 1, None, "dot_general"),  # weight-only at prefill: dequantise + dot
    ):
        lowered = lower_for_cuda(
            lambda x, w: fp8_linear(x, w, backend="pallas_gpu", mode=mode, variant=variant),  # noqa: B023
            jax.ShapeDtypeStruct((rows, 1000), jnp.bfloat16),
            weight,
        )
        assert name in lowered.as_text(), (mode, rows, variant)
        assert name != "weight_only_linear" or "w8a8_linear" not in lowered.as_text()
        assert name != "dot_general" or "weight_only_linear" not in lowered.as_text()
    weight = random_weight(*MOSAIC_WEIGHT)
    for rows, mosaic in ((MOSAIC_MIN_ROWS, True), (MOSAIC_MIN_ROWS - 1, False)):
        lowered = lower_for_cuda(
            lambda x, w: fp8_linear(x, w, backend="pallas_gpu", mode=W8A8),
            jax.ShapeDtypeStruct((rows, MOSAIC_WEIGHT[1]), jnp.bfloat16),
            weight,
        )
        assert ("mosaic_gpu" in lowered.as_text()) == mosaic  # 128 x 128 blocks, sides multiples of 128
        assert ("w8a8_linear_mgpu_kernel" in lowered.as_text()) == mosaic  # named in a profile


@pytest.mark.parametrize("rows, head_dim", [(1, 128), (GEMV_MAX_ROWS, 256)], ids=["fma", "dot-heads_of_2_blocks"])
def test_gemv_gated_norm_prologue_lowers_for_cuda(rows, head_dim):
    """The gemv with its gated-norm prologue at Ling-3.0-flash's output projection (4,096 inputs, 2,560 outputs,
    128 x 128 blocks), its heads of 128 in FMA products; heads of two K blocks in tensor-core products."""
    shape, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    x = shape((rows, 4096), bf16)
    weight = (shape((2560, 4096), jnp.float8_e4m3fn), shape((20, 32), jnp.float32))
    norm = GatedHeadNorm(x, shape((head_dim,), bf16), 1e-6)
    gemv = functools.partial(weight_only_gemv_partials_gpu, block=(128, 128))
    lowered = lower_for_cuda(lambda x, values, scales, norm: gemv(x, values, scales, norm=norm), x, *weight, norm)
    assert "weight_only_gemv_gated_norm" in lowered.as_text()


def grouped_case(rows: int, dtype):
    """x [rows, 1000] and MLA's q_a / kv_a shapes (1536 and 576 outputs: 4.5 row blocks) as the grouped kernel's
    operands."""
    weights = [random_weight(1536, 1000, seed=rows), random_weight(576, 1000, seed=rows + 1)]
    values, scales, blocks = (tuple(getattr(w, name) for w in weights) for name in ("values", "scales", "block"))
    return random_x((rows, 1000), dtype, seed=rows + 2), weights, values, scales, blocks


def test_grouped_gemv_lowers_for_cuda():
    """FMA products at 1 row, through `fp8_linear_many`; tensor-core dots at GEMV_MAX_ROWS, the kernel by name."""
    _, weights, values, scales, blocks = grouped_case(1, jnp.bfloat16)
    for rows, fn, args in (
        (1, lambda x, ws: fp8_linear_many(x, ws, backend="pallas_gpu"), (weights,)),
        (GEMV_MAX_ROWS, functools.partial(weight_only_gemv_many_gpu, blocks=blocks), (values, scales)),
    ):
        lowered = lower_for_cuda(fn, jax.ShapeDtypeStruct((rows, 1000), jnp.bfloat16), *args)
        assert "weight_only_gemv_many" in lowered.as_text(), rows


@gpu_test("the compiled grouped FP8 gemv")
@pytest.mark.parametrize("rows", [1, 2, 13])
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_compiled_grouped_gemv_matches_float64(rows, dtype, tol):
    x, weights, values, scales, blocks = grouped_case(rows, dtype)
    ys = weight_only_gemv_many_gpu(x, values, scales, blocks=blocks)
    for y, weight in zip(ys, weights, strict=True):
        assert y.dtype == dtype and rel_error(y, f64(x) @ float64_weight(weight).T) <= tol


@gpu_test("the compiled FP8 gemv with its gated-norm prologue")
@pytest.mark.parametrize("rows", [1, 2, GEMV_MAX_ROWS])
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_compiled_gemv_gated_norm_prologue_matches_reference(rows, dtype, tol):
    """Ling-3.0-flash's KDA output projection (32 heads of 128 in, 2,560 out, 128 x 128 blocks) with the tuned tiles:
    the decode batches' FMA products and GEMV_MAX_ROWS' tensor-core ones, against the norm then the product (jnp)."""
    x, norm = gated_norm_case(rows, 32, 128, dtype, seed=rows)
    weight = random_weight(2560, 4096, seed=rows + 1)
    partials = weight_only_gemv_partials_gpu(x, weight.values, weight.scales, block=weight.block, norm=norm)
    with jax.default_matmul_precision("highest"):  # XLA's default fp32 dot on a GPU is TF32: 2.9e-4 off here
        want = weight_only_linear_reference(gated_head_norm(x, norm), weight.values, weight.scales, weight.block)
    assert rel_error(jnp.sum(partials, axis=0), want) <= tol


@gpu_test("the compiled FP8 kernels")
@pytest.mark.parametrize("rows", [1, 3, 13, 300])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_compiled_kernels_match_float64(rows, dtype):
    """576 outputs (kv_a_proj's 4.5 row blocks), 1000 inputs; both modes at every row count, weight-only by
    both kernels where the decode-shaped one takes the rows (3 rows: its fma_rows tiles, summed after each K block;
    13 rows in bf16: its dot products)."""
    weight, x = random_weight(576, 1000, seed=rows), random_x((rows, 1000), dtype, seed=rows + 1)
    w_NK = float64_weight(weight)
    bf16 = dtype == jnp.bfloat16
    weight_only_variants = ("gpu_triton", GEMV) if rows <= GEMV_MAX_ROWS else ("gpu_triton",)
    for mode, variant, x_64, tol in (
        *((WEIGHT_ONLY, variant, f64(x), 1e-2 if bf16 else 1e-4) for variant in weight_only_variants),
        *(
            (W8A8, variant, float64_quantized_x(f64(x), 128), 1e-2 if bf16 else 1e-3)
            for variant in ("gpu_triton", TC_ACC)
        ),
    ):
        y = fp8_linear(x, weight, backend="pallas_gpu", mode=mode, variant=variant)
        assert y.dtype == dtype and bool(jnp.all(jnp.isfinite(y)))
        assert rel_error(y, x_64 @ w_NK.T) <= tol, (mode, variant)


# jax 0.10's Mosaic GPU interpreter cannot read the K-major (transposed) weight operand of the FP8 wgmma
needs_mgpu_interpreter = pytest.mark.skipif(
    tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11),
    reason=f"jax {jax.__version__}'s Mosaic GPU interpreter cannot run transposed wgmma operands (jax >= 0.11 can); "
    "the Mosaic W8A8 kernel's CUDA lowering is tested here and the compiled kernel on the GPU",
)
MOSAIC_WEIGHT = (256, 384)  # N, K: multiples of the kernel's 128


def mosaic_case(rows: int, dtype, seed: int, shape: tuple[int, int] = MOSAIC_WEIGHT):
    weight, x = random_weight(*shape, seed=seed), random_x((rows, shape[1]), dtype, seed=seed + 1)
    return weight, x, float64_quantized_x(f64(x), 128) @ float64_weight(weight).T


@needs_mgpu_interpreter
@pytest.mark.parametrize("rows", [5, 70])
def test_mosaic_w8a8_kernel_matches_float64(rows):
    """70 rows: two 64-row tiles, the second padded; 256 outputs in tiles of 128 (and 64); 3 K blocks."""
    weight, x, expected = mosaic_case(rows, jnp.float32, seed=rows)
    mosaic = kernel("w8a8_linear", MOSAIC)
    for block_n in (128, 64):
        y = mosaic(x, weight.values, weight.scales, block=weight.block, tiles=MosaicTiles(block_n, 2), interpret=True)
        assert y.shape == (rows, MOSAIC_WEIGHT[0]) and rel_error(y, expected) <= 1e-3, block_n


def test_mosaic_w8a8_kernel_lowers_for_cuda_and_refuses_other_shapes():
    weight = random_weight(*MOSAIC_WEIGHT)
    lowered = lower_for_cuda(
        lambda x, w: fp8_linear(x, w, backend="pallas_gpu", mode=W8A8, variant=MOSAIC),
        jax.ShapeDtypeStruct((300, MOSAIC_WEIGHT[1]), jnp.bfloat16),
        weight,
    )
    assert "mosaic_gpu" in lowered.as_text()
    with pytest.raises(ValueError, match="w8a8_linear_mgpu takes 128 x 128 weight blocks"):
        fp8_linear(
            random_x((3, 200), jnp.bfloat16), random_weight(256, 200), backend="pallas_gpu", variant=MOSAIC, mode=W8A8
        )


@gpu_test("the compiled Mosaic GPU W8A8 kernel")
@pytest.mark.parametrize("rows", [13, 300])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_compiled_mosaic_w8a8_kernel_matches_float64(rows, dtype):
    """The default tiles and the output written by TMA through shared memory (64-column tiles)."""
    weight, x, expected = mosaic_case(rows, dtype, seed=rows)
    y = fp8_linear(x, weight, backend="pallas_gpu", mode=W8A8, variant=MOSAIC)
    assert y.dtype == dtype and bool(jnp.all(jnp.isfinite(y)))
    assert rel_error(y, expected) <= (1e-2 if dtype == jnp.bfloat16 else 1e-3)
    mosaic = kernel("w8a8_linear", MOSAIC)
    for tiles in (MosaicTiles(128, 4, tma_store=True), MosaicTiles(64, 3, tma_store=True)):
        y = mosaic(x, weight.values, weight.scales, block=weight.block, tiles=tiles)
        assert y.dtype == dtype and rel_error(y, expected) <= (1e-2 if dtype == jnp.bfloat16 else 1e-3), tiles
