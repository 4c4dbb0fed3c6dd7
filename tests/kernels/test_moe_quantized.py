"""Weight-only quantised MoE kernels (block-FP8 and MXFP4 experts read as stored, each tile dequantised on chip):
`gather_swiglu`, `down_scatter` and `routed_experts`, in Pallas interpret mode and as the dequantise-then-reference
path, against float64 numpy (the weights dequantised in float64 from the spec's formulas, §6.2 / §6.3, then the
FFN); the GPU wiring of `ling_jax.moe.experts` (no dense copy of an expert), expert parallelism and a whole FP8
checkpoint on the interpret GPU backend; CUDA lowering at Ling-3.1-flash size; the compiled kernels on a GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import gpu_test, lower_for_cuda, rel_error
from test_fused_experts import float64_down_scatter, float64_gather_swiglu, routing, sorted_rows
from test_routed_experts import float64_loop

from ling_jax.moe.expert_parallel import moe_parallel
from ling_jax.moe.experts import ROW_PATH_MAX_ROWS, SharedExpert, local_moe
from ling_jax.quantized import BlockFP8Weight, MXFP4Weight
from ling_jax.sharding import make_mesh
from pallas_kernels.moe.ops import WEIGHT_ONLY, down_scatter, gather_swiglu, kernel, routed_experts

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


CASES = [(fmt, jnp.float32, "interpret_gpu") for fmt in FORMATS] + [
    ("fp8", jnp.bfloat16, "interpret_gpu"),
    ("mxfp4", jnp.bfloat16, "interpret_gpu"),
    ("fp8_1x32", jnp.float32, "reference"),
    ("mxfp4", jnp.float32, "reference"),
]
CASE_IDS = [f"{fmt}-{jnp.dtype(dtype).name}-{backend}" for fmt, dtype, backend in CASES]


@pytest.mark.parametrize(("fmt", "dtype", "backend"), CASES, ids=CASE_IDS)
def test_gather_swiglu_matches_float64(fmt, dtype, backend):
    order, sizes, source, _ = routed_rows(seed=1)
    x = activations((TOKENS, HIDDEN), dtype, seed=2)
    gate, up = (quantized(fmt, (EXPERTS, WIDTH, HIDDEN), seed) for seed in (3, 4))
    h = gather_swiglu(jnp.asarray(x, dtype), jnp.asarray(source), jnp.asarray(sizes), gate, up, 0.9, backend=backend)
    assert h.dtype == dtype and h.shape == (len(source), WIDTH)
    assert not np.any(np.asarray(h[sizes.sum() :], np.float32)), "tail rows are not 0"
    expected = float64_gather_swiglu(x, source, sizes, float64_dense(gate), float64_dense(up), 0.9)
    assert np.mean(np.abs(expected) >= 0.9 * 0.9) > 0.01, "the clip is never reached"
    err = rel_error(h, expected)
    print(f"[moe quantized] gather_swiglu {fmt} {jnp.dtype(dtype).name} {backend}: rel. error {err:.2e}")
    assert err <= TOL[dtype], f"{fmt} {jnp.dtype(dtype).name} {backend}: rel. error {err:.2e}"


@pytest.mark.parametrize(("fmt", "dtype", "backend"), CASES, ids=CASE_IDS)
def test_down_scatter_matches_float64(fmt, dtype, backend):
    order, sizes, _, row_weight = routed_rows(seed=5)
    h = activations((len(order), WIDTH), dtype, seed=6)
    down = quantized(fmt, (EXPERTS, HIDDEN, WIDTH), seed=7)
    y = down_scatter(
        jnp.asarray(h, dtype), jnp.asarray(order), jnp.asarray(row_weight), jnp.asarray(sizes), down, backend=backend
    )
    assert y.dtype == dtype and y.shape == (len(order), HIDDEN)
    assert not np.any(np.asarray(y[order[sizes.sum() :]], np.float32)), "tail rows are not 0"
    err = rel_error(y, float64_down_scatter(h, order, row_weight, sizes, float64_dense(down)))
    print(f"[moe quantized] down_scatter {fmt} {jnp.dtype(dtype).name} {backend}: rel. error {err:.2e}")
    assert err <= TOL[dtype], f"{fmt} {jnp.dtype(dtype).name} {backend}: rel. error {err:.2e}"


# (format, (block_m, block_n, block_k, weight_left)): tiles smaller than an MXFP4 group, spanning two groups, a
# tile a 24 x 48 block does not divide (scales gathered a row and a column), the weight tile as the dot's first
# operand
@pytest.mark.parametrize(
    ("fmt", "tiles"),
    [
        ("mxfp4", (16, 16, 16, False)),
        ("mxfp4", (32, 32, 64, False)),
        ("fp8_24x48", (32, 32, 64, False)),
        ("fp8_1x32", (16, 32, 128, False)),
        ("fp8", (16, 32, 32, True)),
        ("mxfp4", (16, 32, 32, True)),
    ],
    ids=["mxfp4-16x16x16", "mxfp4-32x32x64", "fp8_24x48", "fp8_1x32-16x32x128", "fp8-left", "mxfp4-left"],
)
def test_fused_kernels_with_other_tiles(fmt, tiles):
    block_m, block_n, block_k, weight_left = tiles
    order, sizes, source, row_weight = routed_rows(seed=8)
    x = activations((TOKENS, HIDDEN), jnp.float32, seed=9)
    gate, up = (quantized(fmt, (EXPERTS, WIDTH, HIDDEN), seed) for seed in (10, 11))
    down = quantized(fmt, (EXPERTS, HIDDEN, WIDTH), seed=12)
    args = {"block_m": block_m, "block_n": block_n, "block_k": block_k, "weight_left": weight_left, "interpret": True}
    h = kernel("gather_swiglu", WEIGHT_ONLY)(
        jnp.asarray(x), jnp.asarray(source), jnp.asarray(sizes), gate, up, limit=0.9, **args
    )
    expected_h = float64_gather_swiglu(x, source, sizes, float64_dense(gate), float64_dense(up), 0.9)
    assert rel_error(h, expected_h) <= TOL[jnp.float32]
    y = kernel("down_scatter", WEIGHT_ONLY)(
        h, jnp.asarray(order), jnp.asarray(row_weight), jnp.asarray(sizes), down, **args
    )
    expected_y = float64_down_scatter(np.asarray(h), order, row_weight, sizes, float64_dense(down))
    assert rel_error(y, expected_y) <= TOL[jnp.float32]


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
    ("fmt", "shared_fmt", "dtype"),
    [("fp8", "fp8", jnp.float32), ("mxfp4", "fp8_1x32", jnp.float32), ("mxfp4_f32", None, jnp.bfloat16)],
    ids=["fp8-shared-fp8", "mxfp4-shared-fp8", "mxfp4-f32-bf16"],
)
def test_routed_experts_match_float64(fmt, shared_fmt, dtype):
    """The decode row kernels, invalid slots included; the shared expert in a format of its own (one more row
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
    )
    assert ours.dtype == dtype
    dense = [float64_dense(w) for w in (gate, up, down)]
    shared64 = None if shared is None else tuple(float64_dense(w) for w in shared)
    err = rel_error(ours, float64_loop(x, weights, experts, *dense, 0.9, shared64, 0.5))
    print(f"[moe quantized] routed_experts {fmt} (shared {shared_fmt}) {jnp.dtype(dtype).name}: rel. error {err:.2e}")
    assert err <= TOL[dtype]


def test_refused_weights():
    """A dense variant named for quantised experts, the weight-only kernels given dense ones, FP8 values that are
    not e4m3: one clear error each, before any kernel runs."""
    order, sizes, source, _ = routed_rows(seed=1)
    x = jnp.asarray(activations((TOKENS, HIDDEN), jnp.float32, seed=2))
    gate = quantized("fp8", (EXPERTS, WIDTH, HIDDEN), seed=3)
    rows = (x, jnp.asarray(source), jnp.asarray(sizes))
    with pytest.raises(ValueError, match="variant 'gpu_triton' of gather_swiglu takes dense expert weights"):
        gather_swiglu(*rows, gate, gate, None, backend="interpret_gpu", variant="gpu_triton")
    dense = gate.dequantize(jnp.float32)
    with pytest.raises(
        ValueError,
        match=r"gate: the weight-only kernels take a quantised weight .* got a dense float32 \(5, 136, 200\)",
    ):
        kernel("gather_swiglu", WEIGHT_ONLY)(*rows, dense, gate, limit=None, interpret=True)
    bad = BlockFP8Weight(gate.values.astype(jnp.bfloat16), gate.scales, gate.block)
    with pytest.raises(ValueError, match="up: block-FP8 values must be float8_e4m3fn, got bfloat16"):
        gather_swiglu(*rows, gate, bad, None, backend="interpret_gpu")


def dense_shapes_in(jaxpr) -> set[str]:
    """The dense expert stacks ([E, I, D] or [E, D, I]) in fp32 or bf16 that a program makes anywhere."""
    text = str(jaxpr)
    shapes = (f"{EXPERTS},{WIDTH},{HIDDEN}", f"{EXPERTS},{HIDDEN},{WIDTH}")
    return {f"{dtype}[{shape}]" for dtype in ("f32", "bf16") for shape in shapes if f"{dtype}[{shape}]" in text}


@pytest.mark.parametrize("tokens", [2, TOKENS], ids=["row-path", "fused-path"])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_local_moe_keeps_quantized_experts_quantized_on_gpu(fmt, tokens):
    """On a GPU backend the decode rows and the fused path read the experts as stored (no dense [E, ...] copy in
    the program, where the reference path has them); both equal the reference backend."""
    assert (tokens * TOP_K <= ROW_PATH_MAX_ROWS) == (tokens == 2)
    x, weights, experts, gate, up, down = decode_case(tokens, fmt, jnp.float32, seed=30)
    experts = np.where((experts < 0) | (experts >= EXPERTS), 0, experts)  # the router always picks an expert
    shared_stacks = [
        quantized("fp8", shape, 40 + i) for i, shape in enumerate([(1, WIDTH, HIDDEN)] * 2 + [(1, HIDDEN, WIDTH)])
    ]
    shared = SharedExpert(*(jax.tree.map(lambda a: a[0], w) for w in shared_stacks), 0.5)
    args = (jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts), gate, up, down)
    run = {
        b: jax.jit(functools.partial(local_moe, limit=0.9, shared=shared, backend=b))
        for b in ("interpret_gpu", "reference")
    }
    assert not dense_shapes_in(run["interpret_gpu"].trace(*args).jaxpr)
    assert dense_shapes_in(run["reference"].trace(*args).jaxpr), "the check cannot see a dequantised stack"
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
    with jax.set_mesh(mesh):
        y, _ = jax.jit(
            lambda *a: moe_parallel(
                *a, limit=0.9, mesh=mesh, capacity_factor=None, backend="interpret_gpu", exchange="dense"
            )
        )(x, weights, experts, gate, up, down)
    expected = local_moe(x, weights, experts, gate, up, down, 0.9, backend="reference")
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


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_weight_only_kernels_lower_for_cuda_at_ling_flash_size(fmt):
    """8192 tokens (the fused kernels) and one token (the row kernels), top-8 of 512 experts, hidden 4096, width
    1280, bf16 activations."""
    shape = jax.ShapeDtypeStruct
    for tokens, names in (
        (8192, ("gather_swiglu", "down_scatter")),
        (1, ("expert_swiglu_rows", "expert_down_combine")),
    ):
        args = (shape((tokens, 4096), jnp.bfloat16), shape((tokens, 8), jnp.float32), shape((tokens, 8), jnp.int32))
        text = lower_for_cuda(
            functools.partial(local_moe, limit=7.0, backend="pallas_gpu"), *args, *flash_experts(fmt)
        ).as_text()
        for name in names:
            assert name in text, (fmt, tokens, name)
    x, source, sizes = shape((8192, 4096), jnp.bfloat16), shape((65536,), jnp.int32), shape((512,), jnp.int32)
    gate, up, _ = flash_experts(fmt)
    weight_left = functools.partial(kernel("gather_swiglu", WEIGHT_ONLY), limit=7.0, weight_left=True)
    assert "gather_swiglu" in lower_for_cuda(weight_left, x, source, sizes, gate, up).as_text()


@gpu_test("the compiled weight-only MoE kernels")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_compiled_kernels_match_float64(fmt, dtype):
    order, sizes, source, row_weight = routed_rows(seed=60)
    x = activations((TOKENS, HIDDEN), dtype, seed=61)
    gate, up = (quantized(fmt, (EXPERTS, WIDTH, HIDDEN), seed) for seed in (62, 63))
    down = quantized(fmt, (EXPERTS, HIDDEN, WIDTH), seed=64)
    h = gather_swiglu(
        jnp.asarray(x, dtype), jnp.asarray(source), jnp.asarray(sizes), gate, up, 0.9, backend="pallas_gpu"
    )
    dense = [float64_dense(w) for w in (gate, up, down)]
    assert rel_error(h, float64_gather_swiglu(x, source, sizes, *dense[:2], 0.9)) <= TOL[dtype]
    y = down_scatter(h, jnp.asarray(order), jnp.asarray(row_weight), jnp.asarray(sizes), down, backend="pallas_gpu")
    h64 = np.asarray(h, np.float32)
    assert rel_error(y, float64_down_scatter(h64, order, row_weight, sizes, dense[2])) <= TOL[dtype]
    x, weights, experts, gate, up, down = decode_case(3, fmt, dtype, seed=65)
    ours = routed_experts(
        jnp.asarray(x, dtype), jnp.asarray(weights), jnp.asarray(experts), gate, up, down, 0.9, backend="pallas_gpu"
    )
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
    (the row path) with every GPU kernel interpreted == the reference backend, fp32; the MoE kernels are the
    weight-only ones."""
    from flax import nnx

    from ling_jax import ExecutionPolicy, KernelBackend, load_hf_checkpoint

    ids = jnp.asarray(np.random.default_rng(3).integers(2, 100, (2, 12)))

    @functools.partial(jax.jit, static_argnums=0)
    def prefill_and_one_token(graph, state, ids):
        model = nnx.merge(graph, state)
        return model(ids).logits, model(ids[:, :1]).logits

    logits = {}
    for backend in (KernelBackend.INTERPRET_GPU, KernelBackend.REFERENCE):
        model = load_hf_checkpoint(
            fp8_checkpoint, dtype=jnp.float32, progress=False, policy=ExecutionPolicy(kernel_backend=backend)
        )
        assert isinstance(model.model.layers[1].mlp.experts.up_proj.get_value(), BlockFP8Weight)
        traced = prefill_and_one_token.trace(*nnx.split(model), ids)
        kernels = {"gather_swiglu", "down_scatter", "expert_swiglu_rows", "expert_down_combine"}
        found = {name for name in kernels if f"name={name}" in str(traced.jaxpr)}
        assert found == (kernels if backend == KernelBackend.INTERPRET_GPU else set()), (backend, found)
        logits[backend] = traced.lower().compile()(*nnx.split(model)[1:], ids)
    for what, ours, ref in zip(("prefill", "one token"), *logits.values()):
        err = rel_error(ours, ref)
        print(f"[moe quantized] FP8 checkpoint, {what}: interpret GPU vs reference logits rel. error {err:.2e}")
        assert err <= TOL[jnp.float32], what


@pytest.mark.parametrize("tokens", [2, TOKENS], ids=["row-path", "fused-path"])
def test_gradients_through_the_weight_only_kernels(tokens):
    """d/dx and d/d routing weights through the weight-only kernels (dequantise-then-reference backward pass)."""
    x, weights, experts, gate, up, down = decode_case(tokens, "mxfp4", jnp.float32, seed=70)
    experts = jnp.asarray(np.where((experts < 0) | (experts >= EXPERTS), 0, experts))

    def loss(backend, x, weights):
        return jnp.sum(jnp.sin(local_moe(x, weights, experts, gate, up, down, 0.9, backend=backend)))

    ours, ref = (
        jax.jit(jax.grad(functools.partial(loss, backend), argnums=(0, 1)))(jnp.asarray(x), jnp.asarray(weights))
        for backend in ("interpret_gpu", "reference")
    )
    for name, a, b in zip(("x", "weights"), ours, ref):
        assert rel_error(a, b) <= TOL[jnp.float32], f"d/d{name}: {rel_error(a, b):.2e}"


@gpu_test("the compiled weight-only MoE kernels")
@pytest.mark.parametrize("tokens", [8192, 64])
def test_compiled_fp8_experts_at_ling_flash_size_match_the_dequantised_ones(tokens):
    """hidden 4096, width 1280, top-8 of 512 FP8 experts (128 x 128 blocks), bf16: `local_moe` with the experts
    kept FP8 (the weight-only fused kernels) == with them dequantised to bf16 first (the bf16 kernels)."""
    hidden, width, num_experts, top_k = 4096, 1280, 512, 8
    keys = jax.random.split(jax.random.key(tokens), 8)

    def fp8_stack(key, rows, cols):
        values = (jax.random.normal(key, (num_experts, rows, cols), jnp.bfloat16) * 64).astype(jnp.float8_e4m3fn)
        grid = (num_experts, -(-rows // 128), -(-cols // 128))
        scales = jax.random.uniform(jax.random.fold_in(key, 1), grid, jnp.float32, 0.5, 1.5) / (64 * cols**0.5)
        return BlockFP8Weight(values, scales, (128, 128))

    stacks = (fp8_stack(keys[0], width, hidden), fp8_stack(keys[1], width, hidden), fp8_stack(keys[2], hidden, width))
    experts = jax.vmap(lambda k: jax.random.permutation(k, num_experts)[:top_k])(jax.random.split(keys[3], tokens))
    weights = jax.random.uniform(keys[4], (tokens, top_k), jnp.float32, 0.1, 1.0)
    x = jax.random.normal(keys[5], (tokens, hidden), jnp.bfloat16)
    run = jax.jit(functools.partial(local_moe, limit=7.0, backend="pallas_gpu"))
    ours = run(x, weights, experts.astype(jnp.int32), *stacks)
    dense = run(x, weights, experts.astype(jnp.int32), *(w.dequantize(jnp.bfloat16) for w in stacks))
    err = float(jnp.linalg.norm((ours - dense).astype(jnp.float32)) / jnp.linalg.norm(dense.astype(jnp.float32)))
    print(f"[moe quantized] {tokens} tokens, FP8 experts kept vs dequantised, bf16: rel. error {err:.2e}")
    assert err <= TOL[jnp.bfloat16]
