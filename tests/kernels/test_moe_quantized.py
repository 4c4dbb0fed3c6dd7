"""Weight-only quantised MoE kernels (block-FP8 and MXFP4 experts read as stored, each tile dequantised on chip):
`gather_swiglu`, `down_scatter` and `routed_experts`, in Pallas interpret mode and as the dequantise-then-reference
path, against float64 numpy (the weights dequantised in float64 from the spec's formulas, §6.2 / §6.3, then the
FFN); the GPU wiring of `ling_jax.moe.experts` (no dense copy of an expert), expert parallelism and a whole FP8
checkpoint on the interpret GPU backend; CUDA lowering at Ling-3.1-flash size; the compiled kernels on a GPU."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import fp8_values_paired, gpu_test, int32_offsets_into_large_operands, lower_for_cuda, rel_error
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from test_fused_experts import float64_down_scatter, float64_gather_swiglu, routing, sorted_rows
from test_routed_experts import float64_loop

from ling_jax.moe.expert_parallel import moe_parallel
from ling_jax.moe.experts import SharedExpert, local_moe
from ling_jax.policy import ExecutionPolicy
from ling_jax.quantized import BlockFP8Weight, MXFP4Weight
from ling_jax.sharding import make_mesh
from pallas_kernels.compat import widen_triton_offsets
from pallas_kernels.moe.gpu_triton.weight_tiles import pairs_needed
from pallas_kernels.moe.ops import (
    WEIGHT_ONLY,
    ExpertWeights,
    Routing,
    down_scatter,
    gather_swiglu,
    kernel,
    routed_experts,
)
from pallas_kernels.moe.tuned import ROW_PATH_MAX_ROWS

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}
TOKENS, TOP_K, EXPERTS, HIDDEN, WIDTH = 29, 3, 5, 200, 136  # 87 rows, D and I off every tile and scale block
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# format -> what `quantized` draws: block FP8 with the checkpoints' 128 x 128 blocks (one scale a tile), block FP8
# with 1 x 32 blocks (the converter's MXFP4 experts as E4M3 codes: a scale a row and a 32-input group in a tile),
# MXFP4 with E8M0 or float32 scales
FORMATS = ("fp8", "fp8_1x32", "mxfp4", "mxfp4_f32")


def quantized(fmt: str, shape, seed: int):
    """A random quantised expert stack of dense shape [E, N, K], entries of about 1 / sqrt(K)."""
    r = np.random.default_rng(seed)
    experts, rows, cols = shape
    if fmt.startswith("fp8"):
        block = {"fp8_1x32": (1, 32), "fp8_24x48": (24, 48)}.get(fmt, (128, 128))
        values = (r.normal(size=shape) * 64).astype(ml_dtypes.float8_e4m3fn)
        grid = (experts, -(-rows // block[0]), -(-cols // block[1]))
        scales = r.uniform(0.5, 1.5, grid).astype(np.float32) / (64 * cols**0.5)
        return BlockFP8Weight(jnp.asarray(values), jnp.asarray(scales), block)
    codes = r.integers(0, 256, (experts, rows, cols // 2), dtype=np.uint8)
    scales = np.ldexp(1.0, r.integers(-8, -4, (experts, rows, -(-cols // 32)))).astype(np.float32)
    if fmt == "mxfp4":
        scales = scales.astype(ml_dtypes.float8_e8m0fnu)
    return MXFP4Weight(jnp.asarray(codes), jnp.asarray(scales))


def float64_dense(weight) -> np.ndarray:
    """The weight in float64 from the spec: W[r, c] = e4m3[r, c] * scale[r // br, c // bc] (§6.2), or
    E2M1(nibble c of row r: byte c // 2, low nibble first) * scale[r, c // 32] (§6.3)."""
    values, scales = np.asarray(weight.values), np.asarray(weight.scales).astype(np.float64)
    if isinstance(weight, BlockFP8Weight):
        rows, cols = values.shape[-2:]
        full = np.repeat(np.repeat(scales, weight.block[0], axis=-2), weight.block[1], axis=-1)
        return values.astype(np.float64) * full[..., :rows, :cols]
    codes = np.stack([values & 0x0F, values >> 4], axis=-1).reshape(*values.shape[:-1], -1)
    return E2M1[codes] * np.repeat(scales, 32, axis=-1)[..., : codes.shape[-1]]


def activations(shape, dtype, seed):
    """Normal floats as float32 numpy, rounded to dtype."""
    r = np.random.default_rng(seed)
    return np.asarray(jnp.asarray(r.normal(size=shape), dtype).astype(jnp.float32))


def routed_rows(seed):
    """(x [T, D], row weights [R] in sorted order, source, order, sizes): ragged groups, an empty expert (0),
    an expert with one row (1) and one assignment to no expert (a tail row)."""
    experts = routing(TOKENS, TOP_K, EXPERTS, seed)
    order, sizes, source = sorted_rows(experts, EXPERTS)
    weights = np.random.default_rng(seed).uniform(0.1, 1.0, TOKENS * TOP_K).astype(np.float32)
    return order, sizes, source, weights[order]


# (format, dtype, hidden, tiles (block_m, block_n, block_k, weight_left) or None: the tuned ones, FP8 values as
# uint16 pairs even at this size), each run through the weight-only fused kernels (interpreted): the checkpoints'
# blocks at the tuned tiles; a weight tile spanning two MXFP4 groups (float scales, the weight tile as the dot's
# first operand); tiles smaller than a group; a 24 x 48 block no tile divides (scales gathered a row and a column)
# with an odd hidden size (gate and up cannot pair); one scale a row and a 32-input group (unpaired); FP8 with the
# weight tile first
FUSED_CASES = [
    ("fp8", jnp.float32, HIDDEN, None, True),
    ("mxfp4_f32", jnp.float32, HIDDEN, (32, 32, 64, True), False),
    ("mxfp4", jnp.bfloat16, HIDDEN, (16, 16, 16, False), False),
    ("fp8_24x48", jnp.float32, HIDDEN + 1, (32, 32, 64, False), True),
    ("fp8_1x32", jnp.float32, HIDDEN, (16, 32, 128, False), False),
    ("fp8", jnp.bfloat16, HIDDEN, (16, 32, 32, True), True),
]


@pytest.mark.parametrize(
    ("fmt", "dtype", "hidden", "tiles", "pairs"),
    FUSED_CASES,
    ids=[f"{c[0]}-{jnp.dtype(c[1]).name}-{c[2]}-{c[3]}{'-pairs' * c[4]}" for c in FUSED_CASES],
)
def test_weight_only_fused_kernels_match_float64(fmt, dtype, hidden, tiles, pairs):
    """gather_swiglu then down_scatter with the weight-only variant: h and y against float64 from the spec's
    dequantisation, the clip reached, tail rows 0."""
    with fp8_values_paired() if pairs else contextlib.nullcontext():
        run_weight_only_fused_kernels(fmt, dtype, hidden, tiles)


def run_weight_only_fused_kernels(fmt, dtype, hidden, tiles):
    order, sizes, source, row_weight = routed_rows(seed=1)
    x = activations((TOKENS, hidden), dtype, seed=2)
    gate, up = (quantized(fmt, (EXPERTS, WIDTH, hidden), seed) for seed in (3, 4))
    down = quantized(fmt, (EXPERTS, hidden, WIDTH), seed=7)
    names = ("block_m", "block_n", "block_k", "weight_left")
    given = {"interpret": True, **({} if tiles is None else dict(zip(names, tiles)))}
    h = kernel("gather_swiglu", WEIGHT_ONLY)(
        jnp.asarray(x, dtype), jnp.asarray(source), jnp.asarray(sizes), gate, up, limit=0.9, **given
    )
    assert h.dtype == dtype and h.shape == (len(source), WIDTH)
    assert not np.any(np.asarray(h[sizes.sum() :], np.float32)), "tail rows are not 0"
    expected_h = float64_gather_swiglu(x, source, sizes, float64_dense(gate), float64_dense(up), 0.9)
    assert np.mean(np.abs(expected_h) >= 0.9 * 0.9) > 0.01, "the clip is never reached"
    h64 = np.asarray(h, np.float32)
    y = kernel("down_scatter", WEIGHT_ONLY)(
        h, jnp.asarray(order), jnp.asarray(row_weight), jnp.asarray(sizes), down, **given
    )
    assert not np.any(np.asarray(y[order[sizes.sum() :]], np.float32)), "tail rows are not 0"
    errors = (
        rel_error(h, expected_h),
        rel_error(y, float64_down_scatter(h64, order, row_weight, sizes, float64_dense(down))),
    )
    print(f"[moe quantized] weight-only fused {fmt} {jnp.dtype(dtype).name} {tiles}: rel. errors {errors}")
    assert max(errors) <= TOL[dtype], errors


def test_reference_backend_dequantizes():
    """gather_swiglu and down_scatter on the reference backend with MXFP4 and 1 x 32 FP8 experts == float64."""
    order, sizes, source, row_weight = routed_rows(seed=5)
    x = activations((TOKENS, HIDDEN), jnp.float32, seed=6)
    gate, up = quantized("mxfp4", (EXPERTS, WIDTH, HIDDEN), 8), quantized("fp8_1x32", (EXPERTS, WIDTH, HIDDEN), 9)
    down = quantized("fp8_1x32", (EXPERTS, HIDDEN, WIDTH), 10)
    h = gather_swiglu(jnp.asarray(x), jnp.asarray(source), jnp.asarray(sizes), gate, up, 0.9, backend="reference")
    assert rel_error(h, float64_gather_swiglu(x, source, sizes, float64_dense(gate), float64_dense(up), 0.9)) <= 1e-4
    y = down_scatter(h, jnp.asarray(order), jnp.asarray(row_weight), jnp.asarray(sizes), down, backend="reference")
    h64 = np.asarray(h)
    assert rel_error(y, float64_down_scatter(h64, order, row_weight, sizes, float64_dense(down))) <= 1e-4


def decode_case(tokens, fmt, dtype, seed):
    """x [T, D] rounded to dtype, routing weights, experts (distinct per token; an invalid slot with -1 and one
    with E), quantised gate, up, down."""
    r = np.random.default_rng(seed)
    experts = np.stack([r.permutation(EXPERTS)[:TOP_K] for _ in range(tokens)]).astype(np.int32)
    experts[0, -1], experts[-1, 0] = -1, EXPERTS
    weights = r.uniform(0.1, 1.0, (tokens, TOP_K)).astype(np.float32)
    gate, up = (quantized(fmt, (EXPERTS, WIDTH, HIDDEN), seed + s) for s in (1, 2))
    return (
        activations((tokens, HIDDEN), dtype, seed),
        weights,
        experts,
        gate,
        up,
        quantized(fmt, (EXPERTS, HIDDEN, WIDTH), seed + 3),
    )


@pytest.mark.parametrize(
    ("fmt", "shared_fmt", "dtype", "variant"),
    [
        ("fp8", "fp8", jnp.float32, WEIGHT_ONLY),
        ("mxfp4_f32", None, jnp.bfloat16, WEIGHT_ONLY),
        ("mxfp4", "fp8_1x32", jnp.float32, None),
    ],
    ids=["weight-only-fp8-shared-fp8", "weight-only-mxfp4-f32-bf16", "default-mxfp4-shared-fp8"],
)
def test_routed_experts_match_float64(fmt, shared_fmt, dtype, variant):
    """The decode row kernels, invalid slots included, with the opt-in weight-only variant or by default (the
    picked experts dequantised, then the dense kernels); the shared expert in a format of its own (one more row
    per token, its own clip)."""
    x, weights, experts, gate, up, down = decode_case(3, fmt, dtype, seed=13)
    shared = None
    if shared_fmt is not None:  # one-expert stacks, unstacked
        stacks = [
            quantized(shared_fmt, shape, 20 + i)
            for i, shape in enumerate([(1, WIDTH, HIDDEN)] * 2 + [(1, HIDDEN, WIDTH)])
        ]
        shared = tuple(jax.tree.map(lambda a: a[0], w) for w in stacks)
    ours = routed_experts(
        jnp.asarray(x, dtype),
        jnp.asarray(weights),
        jnp.asarray(experts),
        gate,
        up,
        down,
        0.9,
        shared=shared,
        shared_limit=0.5,
        backend="interpret_gpu",
        variant=variant,
    )
    assert ours.dtype == dtype
    dense = [float64_dense(w) for w in (gate, up, down)]
    shared64 = None if shared is None else tuple(float64_dense(w) for w in shared)
    err = rel_error(ours, float64_loop(x, weights, experts, *dense, 0.9, shared64, 0.5))
    print(f"[moe quantized] routed_experts {variant} {fmt} (shared {shared_fmt}): rel. error {err:.2e}")
    assert err <= TOL[dtype]


@pytest.mark.parametrize(("in_flight", "splits"), [(0, 1), (1, 1), (3, 1), (0, 2), (1, 3)])
def test_row_kernels_with_weights_in_flight_match_float64(in_flight, splits):
    """The row kernels with `in_flight` weights loaded a K step (0: all; 1: one after the other, an invalid slot's
    loop empty; 3: the down kernel's top_k + shared experts in groups of 3 and 1, SwiGLU's gate and up together):
    the same products, for tokens with an invalid slot (masked rows) and one without (unmasked loads). Splits > 1:
    the down kernel's 5 K steps of 32 (the last masked) over 2 programs (3 + 2 steps) or 3 (2 + 2 + 1)."""
    from pallas_kernels.moe.gpu_triton.decode import routed_experts_gpu

    x, weights, experts, gate, up, down = decode_case(3, "fp8", jnp.float32, seed=17)
    shared = tuple(
        jax.tree.map(lambda a: a[0], quantized("fp8", shape, 30 + i))
        for i, shape in enumerate([(1, WIDTH, HIDDEN)] * 2 + [(1, HIDDEN, WIDTH)])
    )
    ours = routed_experts_gpu(
        jnp.asarray(x),
        jnp.asarray(weights),
        jnp.asarray(experts),
        gate,
        up,
        down,
        shared,
        limit=0.9,
        shared_limit=0.5,
        interpret=True,
        swiglu_tiles=(None,) * 4 + (in_flight,),
        down_tiles=(None, 32 if splits > 1 else None, None, None, in_flight, splits),
    )
    dense = [float64_dense(w) for w in (gate, up, down)]
    shared64 = tuple(float64_dense(w) for w in shared)
    assert rel_error(ours, float64_loop(x, weights, experts, *dense, 0.9, shared64, 0.5)) <= TOL[jnp.float32]


def test_refused_weights():
    """The weight-only kernels given dense weights, FP8 values that are not e4m3: one clear error each, before any
    kernel runs."""
    order, sizes, source, _ = routed_rows(seed=1)
    x = jnp.asarray(activations((TOKENS, HIDDEN), jnp.float32, seed=2))
    gate = quantized("fp8", (EXPERTS, WIDTH, HIDDEN), seed=3)
    rows = (x, jnp.asarray(source), jnp.asarray(sizes))
    dense = gate.dequantize(jnp.float32)
    with pytest.raises(
        ValueError,
        match=r"gate: the weight-only kernels take a quantised weight .* got a dense float32 \(5, 136, 200\)",
    ):
        kernel("gather_swiglu", WEIGHT_ONLY)(*rows, dense, gate, limit=None, interpret=True)
    bad = BlockFP8Weight(gate.values.astype(jnp.bfloat16), gate.scales, gate.block)
    with pytest.raises(ValueError, match="up: block-FP8 values must be float8_e4m3fn, got bfloat16"):
        gather_swiglu(*rows, gate, bad, None, backend="interpret_gpu", variant=WEIGHT_ONLY)


def dense_shapes_in(jaxpr) -> set[str]:
    """The dense expert stacks ([E, I, D] or [E, D, I]) in fp32 or bf16 that a program makes anywhere."""
    text = str(jaxpr)
    shapes = (f"{EXPERTS},{WIDTH},{HIDDEN}", f"{EXPERTS},{HIDDEN},{WIDTH}")
    return {f"{dtype}[{shape}]" for dtype in ("f32", "bf16") for shape in shapes if f"{dtype}[{shape}]" in text}


@pytest.mark.parametrize(("fmt", "tokens"), [("fp8", 2), ("mxfp4", TOKENS)], ids=["fp8-row-path", "mxfp4-fused-path"])
def test_local_moe_on_gpu_never_dequantizes_the_expert_stack(fmt, tokens):
    """On a GPU backend by default the fused path reads quantised experts as stored (the weight-only kernels), the
    decode rows too for block-FP8 experts (no dequantised picked expert [rows, ...] either) and dequantise only
    the picked MXFP4 experts: none makes a dense [E, ...] stack (the reference does); each equals the reference
    backend, with a quantised shared expert."""
    assert (tokens * TOP_K <= ROW_PATH_MAX_ROWS) == (tokens == 2)
    x, weights, experts, gate, up, down = decode_case(tokens, fmt, jnp.float32, seed=30)
    experts = np.where((experts < 0) | (experts >= EXPERTS), 0, experts)  # the router always picks an expert
    shared_stacks = [
        quantized("fp8", shape, 40 + i) for i, shape in enumerate([(1, WIDTH, HIDDEN)] * 2 + [(1, HIDDEN, WIDTH)])
    ]
    shared = SharedExpert(*(jax.tree.map(lambda a: a[0], w) for w in shared_stacks), 0.5)
    args = (jnp.asarray(x), Routing(jnp.asarray(weights), jnp.asarray(experts)), ExpertWeights(gate, up, down))
    run = {
        b: jax.jit(functools.partial(local_moe, limit=0.9, shared=shared, policy=ExecutionPolicy(kernel_backend=b)))
        for b in ("interpret_gpu", "reference")
    }
    assert not dense_shapes_in(run["interpret_gpu"].trace(*args).jaxpr)
    assert dense_shapes_in(run["reference"].trace(*args).jaxpr), "the check cannot see a dequantised stack"
    for fmt_of_rows, picked in (("fp8", False), ("mxfp4", True)):
        rows_args = (*args[:2], ExpertWeights(*decode_case(tokens, fmt_of_rows, jnp.float32, seed=30)[3:]))
        text = str(run["interpret_gpu"].trace(*rows_args).jaxpr)
        assert (f"f32[{tokens * TOP_K},{WIDTH},{HIDDEN}]" in text) == (picked and tokens == 2), fmt_of_rows
    err = rel_error(run["interpret_gpu"](*args), run["reference"](*args))
    print(f"[moe quantized] local_moe {fmt} {tokens} tokens, interpret GPU vs reference: rel. error {err:.2e}")
    assert err <= TOL[jnp.float32]


def test_expert_parallel_with_quantized_experts():
    """moe_parallel over 8 virtual CPU devices (2 FP8 experts each) with the weight-only kernels inside shard_map
    == the reference backend on one device."""
    tokens, top_k, num_experts = 16, 2, 8
    r = np.random.default_rng(50)
    x = jnp.asarray(activations((tokens, HIDDEN), jnp.float32, 51))
    experts = jnp.asarray(np.stack([r.permutation(num_experts)[:top_k] for _ in range(tokens)]).astype(np.int32))
    weights = jnp.asarray(r.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32))
    gate, up = (quantized("fp8", (num_experts, WIDTH, HIDDEN), seed) for seed in (52, 53))
    down = quantized("fp8", (num_experts, HIDDEN, WIDTH), 54)
    mesh = make_mesh({"expert": 8})
    routing, stacks = Routing(weights, experts), ExpertWeights(gate, up, down)
    policy = ExecutionPolicy(kernel_backend="interpret_gpu", moe_exchange="dense")
    with jax.set_mesh(mesh):
        y, _ = jax.jit(lambda *a: moe_parallel(*a, limit=0.9, mesh=mesh, policy=policy))(x, routing, stacks)
    expected = local_moe(x, routing, stacks, 0.9, policy=ExecutionPolicy(kernel_backend="reference"))
    assert rel_error(y, expected) <= TOL[jnp.float32]


def flash_experts(fmt: str, num_experts: int = 512, hidden: int = 4096, width: int = 1280):
    """Abstract Ling-3.1-flash expert stacks (gate, up, down) stored as `fmt` ("fp8" or "mxfp4")."""
    shape = jax.ShapeDtypeStruct

    def stack(rows, cols):
        if fmt == "fp8":
            scales = shape((num_experts, -(-rows // 128), -(-cols // 128)), jnp.float32)
            return BlockFP8Weight(shape((num_experts, rows, cols), jnp.float8_e4m3fn), scales, (128, 128))
        scales = shape((num_experts, rows, cols // 32), jnp.float8_e8m0fnu)
        return MXFP4Weight(shape((num_experts, rows, cols // 2), jnp.uint8), scales)

    return stack(width, hidden), stack(width, hidden), stack(hidden, width)


def test_int32_offsets_into_a_large_byte_operand_and_the_workaround(monkeypatch):
    """A kernel reading row 2^21 of a uint8 [2^21 + 1, 1024] (2^31 + 1024 elements, < 2^32 bytes): Pallas's own
    Triton lowering indexes it with int32 offsets, which the check reports; with `compat.widen_triton_offsets`
    (applied by the MoE kernels), int64 ones."""
    from jax._src.pallas.triton import lowering

    def kernel(rows_ref, out_ref):
        out_ref[...] = rows_ref[2**21, :].astype(jnp.float32)

    def call(rows):
        out_shape = jax.ShapeDtypeStruct((1024,), jnp.float32)
        return pl.pallas_call(kernel, out_shape=out_shape, compiler_params=plgpu.CompilerParams())(rows)

    rows = jax.ShapeDtypeStruct((2**21 + 1, 1024), jnp.uint8)
    assert widen_triton_offsets()
    assert not int32_offsets_into_large_operands(lower_for_cuda(call, rows))
    widened = lowering._compute_offsets_from_indices
    monkeypatch.setattr(lowering, "_compute_offsets_from_indices", widened.__wrapped__)
    jax.clear_caches()
    assert int32_offsets_into_large_operands(lower_for_cuda(call, rows))


def test_weight_only_kernels_lower_for_cuda_at_ling_flash_size():
    """8192 tokens (the fused kernels, weight tile left and right) and one token (the row kernels), top-8 of 512
    experts, hidden 4096, width 1280, bf16 activations, FP8 and MXFP4: no operand of more than 2^31 elements is
    indexed with int32 offsets (the FP8 values go as stored, `compat.widen_triton_offsets`; also with K odd), in
    the weight-only kernels and in `local_moe`'s default path (the fused weight-only kernels)."""
    shape = jax.ShapeDtypeStruct
    x, source, sizes = shape((8192, 4096), jnp.bfloat16), shape((65536,), jnp.int32), shape((512,), jnp.int32)
    h = shape((65536, 1280), jnp.bfloat16)
    for fmt in ("fp8", "mxfp4"):
        gate, up, down = flash_experts(fmt)
        for weight_left in (False, True):
            gate_up = functools.partial(gather_swiglu, limit=7.0, variant=WEIGHT_ONLY, backend="pallas_gpu")
            down_rows = functools.partial(down_scatter, variant=WEIGHT_ONLY, backend="pallas_gpu")
            if weight_left:
                gate_up = functools.partial(kernel("gather_swiglu", WEIGHT_ONLY), limit=7.0, weight_left=True)
                down_rows = functools.partial(kernel("down_scatter", WEIGHT_ONLY), weight_left=True)
            for lowered, name in (
                (lower_for_cuda(gate_up, x, source, sizes, gate, up), "gather_swiglu"),
                (lower_for_cuda(down_rows, h, source, shape((65536,), jnp.float32), sizes, down), "down_scatter"),
            ):
                assert name in lowered.as_text(), (fmt, name)
                assert not int32_offsets_into_large_operands(lowered), (fmt, name, weight_left)
        one_token = (shape((1, 4096), jnp.bfloat16), shape((1, 8), jnp.float32), shape((1, 8), jnp.int32))
        rows = functools.partial(routed_experts, limit=7.0, variant=WEIGHT_ONLY, backend="pallas_gpu")
        lowered = lower_for_cuda(rows, *one_token, gate, up, down)
        assert "expert_swiglu_rows" in lowered.as_text() and "expert_down_combine" in lowered.as_text()
        assert not int32_offsets_into_large_operands(lowered), (fmt, "rows")
    prefill = (x, shape((8192, 8), jnp.float32), shape((8192, 8), jnp.int32))
    default_path = functools.partial(local_moe, limit=7.0, policy=ExecutionPolicy(kernel_backend="pallas_gpu"))
    lowered = lower_for_cuda(
        lambda x, weights, experts, stacks: default_path(x, Routing(weights, experts), stacks),
        *prefill,
        ExpertWeights(gate, up, down),
    )
    assert not int32_offsets_into_large_operands(lowered), "default path"
    assert not pairs_needed(flash_experts("fp8")[0].values)
    odd_k = BlockFP8Weight(shape((512, 1280, 4095), jnp.float8_e4m3fn), shape((512, 10, 32), jnp.float32), (128, 128))
    assert not int32_offsets_into_large_operands(lower_for_cuda(gate_up, x, source, sizes, odd_k, odd_k))


@gpu_test("the compiled weight-only MoE kernels")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", [None, WEIGHT_ONLY], ids=["default", "weight-only"])
def test_compiled_kernels_match_float64(fmt, dtype, variant):
    order, sizes, source, row_weight = routed_rows(seed=60)
    x = activations((TOKENS, HIDDEN), dtype, seed=61)
    gate, up = (quantized(fmt, (EXPERTS, WIDTH, HIDDEN), seed) for seed in (62, 63))
    down = quantized(fmt, (EXPERTS, HIDDEN, WIDTH), seed=64)
    h = gather_swiglu(
        jnp.asarray(x, dtype),
        jnp.asarray(source),
        jnp.asarray(sizes),
        gate,
        up,
        0.9,
        backend="pallas_gpu",
        variant=variant,
    )
    dense = [float64_dense(w) for w in (gate, up, down)]
    assert rel_error(h, float64_gather_swiglu(x, source, sizes, *dense[:2], 0.9)) <= TOL[dtype]
    rows = (jnp.asarray(order), jnp.asarray(row_weight), jnp.asarray(sizes))
    y = down_scatter(h, *rows, down, backend="pallas_gpu", variant=variant)
    h64 = np.asarray(h, np.float32)
    assert rel_error(y, float64_down_scatter(h64, order, row_weight, sizes, dense[2])) <= TOL[dtype]
    x, weights, experts, gate, up, down = decode_case(3, fmt, dtype, seed=65)
    routing_args = (jnp.asarray(x, dtype), jnp.asarray(weights), jnp.asarray(experts))
    ours = routed_experts(*routing_args, gate, up, down, 0.9, backend="pallas_gpu", variant=variant)
    dense = [float64_dense(w) for w in (gate, up, down)]
    assert rel_error(ours, float64_loop(x, weights, experts, *dense, 0.9)) <= TOL[dtype]


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A tiny block-FP8 checkpoint (16 x 16 blocks, FP8 routed and shared experts) of the oracle's g2_dense1."""
    from checkpoint_factory import make_quantized_checkpoint
    from oracle import build_oracle, save_oracle

    oracle_dir = save_oracle(build_oracle("g2_dense1", seed=2), tmp_path_factory.mktemp("oracle"))
    directory = tmp_path_factory.mktemp("fp8")
    make_quantized_checkpoint(oracle_dir, directory, block=(16, 16))
    return directory


def test_fp8_checkpoint_on_the_interpret_gpu_backend_equals_the_reference(fp8_checkpoint):
    """The whole model from an FP8 checkpoint (weights kept FP8): prefill (the fused path) and one token a sequence
    (the row path) with every GPU kernel interpreted == the reference backend, fp32, both in one program over the
    same weights; the MoE kernels read the experts dequantised in the step (the default)."""
    from flax import nnx

    from ling_jax import ExecutionPolicy, KernelBackend, load_hf_checkpoint

    ids = jnp.asarray(np.random.default_rng(3).integers(2, 100, (2, 12)))
    model = load_hf_checkpoint(
        fp8_checkpoint,
        dtype=jnp.float32,
        progress=False,
        policy=ExecutionPolicy(kernel_backend=KernelBackend.INTERPRET_GPU),
    )
    assert isinstance(model.model.layers[1].mlp.experts.up_proj.get_value(), BlockFP8Weight)
    graph_gpu, state = nnx.split(model)
    model.policy = ExecutionPolicy(kernel_backend=KernelBackend.REFERENCE)
    graph_reference, _ = nnx.split(model)
    assert graph_reference != graph_gpu, "the policy is not part of the graph"

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def prefill_and_one_token(graph_gpu, graph_reference, state, ids):
        models = (nnx.merge(graph, state) for graph in (graph_gpu, graph_reference))
        return [(m(ids).logits, m(ids[:, :1]).logits) for m in models]

    traced = prefill_and_one_token.trace(graph_gpu, graph_reference, state, ids)
    kernels = {"gather_swiglu", "down_scatter", "expert_swiglu_rows", "expert_down_combine"}
    assert {name for name in kernels if f"name={name}" in str(traced.jaxpr)} == kernels
    ours, reference = traced.lower().compile()(state, ids)
    for what, a, b in zip(("prefill", "one token"), ours, reference):
        err = rel_error(a, b)
        print(f"[moe quantized] FP8 checkpoint, {what}: interpret GPU vs reference logits rel. error {err:.2e}")
        assert err <= TOL[jnp.float32], what


def test_gradients_through_the_weight_only_kernels():
    """d/dx and d/d routing weights through the weight-only fused and row kernels (dequantise-then-reference
    backward pass) == through the reference backend, in one program."""
    order, sizes, source, row_weight = routed_rows(seed=70)
    _, weights, experts, gate, up, down = decode_case(2, "mxfp4", jnp.float32, seed=71)
    rows = (jnp.asarray(order), jnp.asarray(source), jnp.asarray(sizes), jnp.asarray(experts))

    def loss(x, weights, row_weight, backend, variant):
        order, source, sizes, experts = rows
        h = gather_swiglu(x, source, sizes, gate, up, 0.9, backend=backend, variant=variant)
        y = down_scatter(h, order, row_weight, sizes, down, backend=backend, variant=variant)
        decoded = routed_experts(x[:2], weights, experts, gate, up, down, 0.9, backend=backend, variant=variant)
        return jnp.sum(jnp.sin(y)) + jnp.sum(jnp.sin(decoded))

    x = jnp.asarray(activations((TOKENS, HIDDEN), jnp.float32, seed=72))
    args = (x, jnp.asarray(weights), jnp.asarray(row_weight))
    ours, ref = (
        jax.jit(jax.grad(functools.partial(loss, backend=backend, variant=variant), argnums=(0, 1, 2)))(*args)
        for backend, variant in (("interpret_gpu", WEIGHT_ONLY), ("reference", None))
    )
    for name, a, b in zip(("x", "weights", "row weights"), ours, ref):
        assert rel_error(a, b) <= TOL[jnp.float32], f"d/d{name}: {rel_error(a, b):.2e}"


def flash_stacks(fmt: str, key):
    """Random Ling-3.1-flash expert stacks (gate, up, down) on the device, entries ~ 1 / sqrt(K): FP8 with
    128 x 128 blocks, or MXFP4 with E8M0 scales."""
    num_experts, hidden, width = 512, 4096, 1280

    def stack(key, rows, cols):
        key_values, key_scales = jax.random.split(key)
        if fmt == "fp8":
            values = jax.random.normal(key_values, (num_experts, rows, cols), jnp.bfloat16) * 64
            grid = (num_experts, -(-rows // 128), -(-cols // 128))
            scales = jax.random.uniform(key_scales, grid, jnp.float32, 0.5, 1.5) / (64 * cols**0.5)
            return BlockFP8Weight(values.astype(jnp.float8_e4m3fn), scales, (128, 128))
        codes = jax.random.bits(key_values, (num_experts, rows, cols // 2), jnp.uint8)
        exponents = jax.random.randint(key_scales, (num_experts, rows, cols // 32), -8, -4)
        return MXFP4Weight(codes, jnp.ldexp(1.0, exponents).astype(jnp.float8_e8m0fnu))

    keys = jax.random.split(key, 3)
    return stack(keys[0], width, hidden), stack(keys[1], width, hidden), stack(keys[2], hidden, width)


@gpu_test("the compiled weight-only MoE kernels")
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_compiled_weight_only_kernels_at_ling_flash_size_match_the_dequantised_path(fmt):
    """hidden 4096, width 1280, top-8 of 512 experts, bf16: the weight-only kernels (the fused ones at 8192
    tokens, the row kernels at 8 tokens) == "gpu_triton" (the experts dequantised to bf16, then the dense
    kernels) on the same weights. Failed for FP8 before the values went as uint16 pairs (int32 offsets)."""
    from pallas_kernels.moe.ops import sort_by_expert

    top_k, num_experts = 8, 512
    stacks = flash_stacks(fmt, jax.random.key(1))
    for tokens in (8192, 8):
        keys = jax.random.split(jax.random.key(tokens), 3)
        experts = jax.vmap(lambda k: jax.random.permutation(k, num_experts)[:top_k])(jax.random.split(keys[0], tokens))
        experts = experts.astype(jnp.int32)
        weights = jax.random.uniform(keys[1], (tokens, top_k), jnp.float32, 0.1, 1.0)
        x = jax.random.normal(keys[2], (tokens, 4096), jnp.bfloat16)
        if tokens > 64:
            order, sizes = jax.jit(sort_by_expert, static_argnums=1)(experts.reshape(-1), num_experts)

            @functools.partial(jax.jit, static_argnums=0)
            def run(variant, gate, up, down, order=order, sizes=sizes, x=x, weights=weights):
                h = gather_swiglu(x, order // top_k, sizes, gate, up, 7.0, backend="pallas_gpu", variant=variant)
                row_weight = weights.reshape(-1)[order]
                return down_scatter(h, order, row_weight, sizes, down, backend="pallas_gpu", variant=variant)
        else:
            run = jax.jit(
                lambda variant, gate, up, down, x=x, weights=weights, experts=experts: routed_experts(
                    x, weights, experts, gate, up, down, 7.0, backend="pallas_gpu", variant=variant
                ),
                static_argnums=0,
            )
        ours, dequantised = (run(variant, *stacks) for variant in (WEIGHT_ONLY, "gpu_triton"))
        err = rel_error(ours, dequantised)
        print(f"[moe quantized] {fmt}, {tokens} tokens, weight-only vs dequantised then dense: rel. error {err:.2e}")
        assert err <= TOL[jnp.bfloat16], (tokens, err)


def test_quantised_experts_take_their_own_launch_defaults():
    """The fused kernels' default tiles: the bf16 tables for dense experts, the *_QUANTIZED ones (and their
    weight_left by bucket) for experts read as stored; a weight_left given wins."""
    from pallas_kernels.moe import tuned
    from pallas_kernels.moe.gpu_triton.fused import _launch_defaults
    from pallas_kernels.moe.gpu_triton.weight_tiles import weight_format

    tables = (tuned.GATHER_SWIGLU, tuned.GATHER_SWIGLU_QUANTIZED)
    dense = (weight_format(jnp.zeros((4, 128, 128), jnp.bfloat16)),)
    fp8 = (weight_format(quantized("fp8", (4, 128, 128), seed=0)),)
    few, many = {"num_rows": 8, "num_groups": 4}, {"num_rows": 4096, "num_groups": 4}
    assert _launch_defaults(dense, tables, None, **few) == (tuned.GATHER_SWIGLU, False)
    assert _launch_defaults(fp8, tables, None, **few) == (tuned.GATHER_SWIGLU_QUANTIZED, True)
    assert _launch_defaults(fp8, tables, None, **many) == (tuned.GATHER_SWIGLU_QUANTIZED, False)
    assert _launch_defaults(fp8, tables, False, **few) == (tuned.GATHER_SWIGLU_QUANTIZED, False)


def test_row_kernels_take_tiles_by_format_and_tokens():
    """The routed-experts row kernels' defaults: the bf16 tables for dense experts; for quantised ones SwiGLU
    (16, 512, 4, 3) and down (8, 128, 4, 3) at one token, every weight in flight, (32, 256, 8, 3) above, one weight
    after the other, the down kernel's width in 3 splits; given ones win, trailing ones not given from the table."""
    from pallas_kernels.moe import tuned
    from pallas_kernels.moe.gpu_triton.decode import launch_tiles
    from pallas_kernels.tuning import lookup

    unset = (None,) * 4
    assert launch_tiles(True, 8, jnp.bfloat16, unset, unset) == tuple(
        dataclasses.astuple(lookup(table, dtype=jnp.bfloat16)) for table in (tuned.ROUTED_SWIGLU, tuned.ROUTED_DOWN)
    )
    assert launch_tiles(False, 1, jnp.bfloat16, unset, unset) == ((16, 512, 4, 3, 0, 1), (8, 128, 4, 3, 0, 3))
    assert launch_tiles(False, 8, jnp.bfloat16, unset, unset) == ((16, 512, 4, 3, 1, 1), (32, 256, 8, 3, 1, 3))
    assert launch_tiles(False, 8, jnp.bfloat16, (8, None, None, None), unset)[0] == (8, 512, 4, 3, 1, 1)
    assert launch_tiles(False, 1, jnp.bfloat16, (8, 256, 4, 3, 1), ())[0] == (8, 256, 4, 3, 1, 1)
