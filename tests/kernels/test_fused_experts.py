"""The fused routed-expert kernels (`gather_swiglu`: rows gathered in the kernel, gate + up + SwiGLU in one pass;
`down_scatter`: row-weighted down projection stored through the sort permutation): Pallas interpret mode and the
jnp reference against float64 numpy loops, gradients against the reference path, the GPU grouped FFN
(`moe_experts` without the row path, `grouped_expert_ffn`, expert parallel) against the dense baseline; CUDA lowering at
Ling-3.1-flash size; the compiled kernels on a GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import lower_for_cuda, rel_error

from ling_jax.moe import expert_parallel
from ling_jax.moe.expert_parallel import moe_parallel
from ling_jax.moe.experts import dense_expert_ffn
from ling_jax.policy import ExecutionPolicy
from ling_jax.sharding import make_mesh
from pallas_kernels.moe.gpu_triton import row_tiles
from pallas_kernels.moe.ops import (
    ExpertKernel,
    ExpertPath,
    ExpertWeights,
    Routing,
    down_scatter,
    expert_path,
    gather_swiglu,
    grouped_expert_ffn,
    kernel,
    moe_experts,
    sort_by_expert,
)
from pallas_kernels.moe.reference import swiglu

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}
DTYPES = pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
gather_swiglu_gpu, down_scatter_gpu = kernel("gather_swiglu", "gpu_triton"), kernel("down_scatter", "gpu_triton")
grouped_matmul_gpu = kernel("grouped_matmul", "gpu_triton")
BACKENDS = pytest.mark.parametrize("backend", ["interpret_gpu", "reference"])
LIMITS = pytest.mark.parametrize("limit", [None, 0.9], ids=["no-limit", "limit"])

# (tokens, top_k, experts, hidden D, width I): token-expert rows not a multiple of any tile, D and I off the
# default tiles, one token, top-1. Every case has an empty expert (0), an expert with one row (1) and an
# assignment to no expert (a tail row).
CASES = {
    "odd": (37, 3, 9, 48, 40),
    "wide": (6, 4, 16, 130, 24),
    "one_token": (1, 3, 6, 32, 16),
    "top1": (23, 1, 5, 16, 48),
}


def routing(tokens, top_k, num_experts, seed):
    """experts [T, k] int32, distinct per token, drawn from experts 2..E-1; then expert 1 gets exactly one
    row and one assignment names no expert (-1), expert 0 none."""
    r = np.random.default_rng(seed)
    experts = np.stack([2 + r.permutation(num_experts - 2)[:top_k] for _ in range(tokens)]).astype(np.int32)
    experts[0, 0] = 1
    experts[-1, -1] = -1 if tokens * top_k > 1 else experts[-1, -1]
    return experts


def random_case(tokens, top_k, num_experts, hidden, width, dtype, seed):
    """x, routing weights, experts, gate, up, down: floats as float32 numpy rounded to dtype, no zeros."""
    r = np.random.default_rng(seed)
    rounded = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # noqa: E731
    return (
        rounded(r.normal(size=(tokens, hidden))),
        r.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32),
        routing(tokens, top_k, num_experts, seed),
        rounded(r.normal(size=(num_experts, width, hidden)) / hidden**0.5),
        rounded(r.normal(size=(num_experts, width, hidden)) / hidden**0.5),
        rounded(r.normal(size=(num_experts, hidden, width)) / width**0.5),
    )


def sorted_rows(experts, num_experts):
    """(order, sizes, source) as numpy: the rows (token, slot) in expert order, rows per expert, and the token
    each sorted row reads (tokens repeat top_k times)."""
    order, sizes = sort_by_expert(jnp.asarray(experts.reshape(-1)), num_experts)
    return np.asarray(order), np.asarray(sizes), np.asarray(order) // experts.shape[1]


def group_of_rows(sizes, num_rows):
    """[R] group of each sorted row, len(sizes) for the tail."""
    return np.repeat(np.arange(len(sizes) + 1), np.r_[sizes, num_rows - sizes.sum()])


def float64_swiglu(gate, up, limit):
    activated = gate / (1 + np.exp(-gate))
    if limit is None:
        return activated * up
    return np.minimum(activated, limit) * np.clip(up, -limit, limit)


def float64_gather_swiglu(x, source, sizes, gate, up, limit):
    """Row by row in float64: swiglu(gate[g] x[source[r]], up[g] x[source[r]]); tail rows 0."""
    h = np.zeros((len(source), gate.shape[1]))
    for row, group in enumerate(group_of_rows(sizes, len(source))):
        if group < len(sizes):
            x_row = x[source[row]].astype(np.float64)
            h[row] = float64_swiglu(gate[group].astype(np.float64) @ x_row, up[group].astype(np.float64) @ x_row, limit)
    return h


def float64_down_scatter(h, dest, row_weight, sizes, down):
    """Row by row in float64: y[dest[r]] = row_weight[r] down[g] h[r]; tail rows 0."""
    y = np.zeros((len(dest), down.shape[1]))
    for row, group in enumerate(group_of_rows(sizes, len(dest))):
        if group < len(sizes):
            y[dest[row]] = row_weight[row] * (down[group].astype(np.float64) @ h[row].astype(np.float64))
    return y


def fused_inputs(case, dtype, seed):
    """(x, row weights in sorted order, source, order, sizes, gate, up, down) for a routing case."""
    tokens, top_k, num_experts, hidden, width = CASES[case]
    x, weights, experts, gate, up, down = random_case(tokens, top_k, num_experts, hidden, width, dtype, seed)
    order, sizes, source = sorted_rows(experts, num_experts)
    return x, weights.reshape(-1)[order], source, order, sizes, gate, up, down


def random_h(rows, width, dtype, seed):
    r = np.random.default_rng(seed)
    return np.asarray(jnp.asarray(r.normal(size=(rows, width)), dtype).astype(jnp.float32))


def gathered_swiglu(x, source, sizes, gate, up, limit, dtype, backend):
    """`gather_swiglu` on the case's numpy arrays, x and the weights cast to `dtype`."""
    args = (jnp.asarray(x, dtype), jnp.asarray(source), jnp.asarray(sizes), jnp.asarray(gate, dtype))
    return gather_swiglu(*args, jnp.asarray(up, dtype), limit, backend=backend)


@BACKENDS
@LIMITS
@pytest.mark.parametrize("case", sorted(CASES))
@DTYPES
def test_gather_swiglu_matches_float64(backend, limit, case, dtype):
    x, _, source, _, sizes, gate, up, _ = fused_inputs(case, dtype, seed=len(case))
    h = gathered_swiglu(x, source, sizes, gate, up, limit, dtype, backend)
    assert h.dtype == dtype and h.shape == (len(source), gate.shape[1])
    assert not np.any(np.asarray(h[sizes.sum() :], np.float32)), "tail rows are not 0"
    err = rel_error(h, float64_gather_swiglu(x, source, sizes, gate, up, limit))
    assert err <= TOL[dtype], f"{backend} {case} {jnp.dtype(dtype).name}: rel. error {err:.2e}"


@BACKENDS
@pytest.mark.parametrize("case", sorted(CASES))
@DTYPES
def test_down_scatter_matches_float64(backend, case, dtype):
    _, row_weight, source, order, sizes, _, _, down = fused_inputs(case, dtype, seed=len(case) + 1)
    h = random_h(len(source), down.shape[2], dtype, seed=3)
    y = down_scatter(
        jnp.asarray(h, dtype),
        jnp.asarray(order),
        jnp.asarray(row_weight),
        jnp.asarray(sizes),
        jnp.asarray(down, dtype),
        backend=backend,
    )
    assert y.dtype == dtype and y.shape == (len(order), down.shape[1])
    assert not np.any(np.asarray(y[order[sizes.sum() :]], np.float32)), "tail rows are not 0"
    err = rel_error(y, float64_down_scatter(h, order, row_weight, sizes, down))
    assert err <= TOL[dtype], f"{backend} {case} {jnp.dtype(dtype).name}: rel. error {err:.2e}"


# (block_m, block_n, block_k): several row tiles per expert, column tiles and K steps, masked N and K.
@pytest.mark.parametrize("tiles", [(16, 16, 16), (16, 32, 32), (32, 16, 64)])
def test_kernels_with_small_tiles(tiles):
    block_m, block_n, block_k = tiles
    x, row_weight, source, order, sizes, gate, up, down = fused_inputs("odd", jnp.float32, seed=block_n)
    args = {"block_m": block_m, "block_n": block_n, "block_k": block_k, "interpret": True}
    h = gather_swiglu_gpu(
        jnp.asarray(x), jnp.asarray(source), jnp.asarray(sizes), jnp.asarray(gate), jnp.asarray(up), limit=0.9, **args
    )
    assert rel_error(h, float64_gather_swiglu(x, source, sizes, gate, up, 0.9)) <= TOL[jnp.float32]
    y = down_scatter_gpu(h, jnp.asarray(order), jnp.asarray(row_weight), jnp.asarray(sizes), jnp.asarray(down), **args)
    assert rel_error(y, float64_down_scatter(np.asarray(h), order, row_weight, sizes, down)) <= TOL[jnp.float32]


def test_kernels_without_the_tail_match_on_the_group_rows():
    """fill_tail=False: no row tile covers the rows past sum(sizes), and the group rows are as with the tail."""
    x, row_weight, source, order, sizes, gate, up, down = fused_inputs("odd", jnp.float32, seed=21)
    used = int(sizes.sum())
    assert used < len(source), "the case needs tail rows"
    _, start_T, end_T = row_tiles(jnp.asarray(sizes), len(source), 16, fill_tail=False)
    covered = np.zeros(len(source), bool)
    for start, end in zip(np.asarray(start_T), np.asarray(end_T)):
        covered[start:end] = True
    assert covered[:used].all() and not covered[used:].any()
    args = [jnp.asarray(a) for a in (x, source, sizes, gate, up)]
    with_tail = gather_swiglu_gpu(*args, limit=0.9, interpret=True)
    without = gather_swiglu_gpu(*args, limit=0.9, fill_tail=False, interpret=True)
    np.testing.assert_array_equal(np.asarray(without[:used]), np.asarray(with_tail[:used]))
    down_args = (jnp.asarray(order), jnp.asarray(row_weight), jnp.asarray(sizes), jnp.asarray(down))
    y_with = down_scatter_gpu(with_tail, *down_args, interpret=True)
    y_without = down_scatter_gpu(with_tail, *down_args, fill_tail=False, interpret=True)
    np.testing.assert_array_equal(np.asarray(y_without[order[:used]]), np.asarray(y_with[order[:used]]))


def test_no_rows_in_any_expert_gives_zeros():
    x, row_weight, source, order, sizes, gate, up, down = fused_inputs("odd", jnp.float32, seed=0)
    no_rows = jnp.zeros_like(jnp.asarray(sizes))
    h = gather_swiglu(
        jnp.asarray(x), jnp.asarray(source), no_rows, jnp.asarray(gate), jnp.asarray(up), None, backend="interpret_gpu"
    )
    y = down_scatter(
        jnp.asarray(random_h(len(order), down.shape[2], jnp.float32, 1)),
        jnp.asarray(order),
        jnp.asarray(row_weight),
        no_rows,
        jnp.asarray(down),
        backend="interpret_gpu",
    )
    assert not np.any(np.asarray(h)) and not np.any(np.asarray(y))


def vjp_of(fn, primals, cotangent):
    """(out, *cotangents of the primals) of fn, in one jitted program."""

    def run(primals, cotangent):
        out, pullback = jax.vjp(fn, *primals)
        return (out, *pullback(cotangent))

    return jax.jit(run)(primals, cotangent)


@pytest.mark.parametrize("case", ["odd", "wide"])
@DTYPES
def test_gather_swiglu_gradients_match_the_reference(case, dtype):
    x, _, source, _, sizes, gate, up, _ = fused_inputs(case, dtype, seed=5)
    d_h = jnp.asarray(random_h(len(source), gate.shape[1], dtype, seed=6), dtype)
    primals = tuple(jnp.asarray(a, dtype) for a in (x, gate, up))

    def fn(backend, x, gate, up):
        return gather_swiglu(x, jnp.asarray(source), jnp.asarray(sizes), gate, up, 0.9, backend=backend)

    got = {backend: vjp_of(functools.partial(fn, backend), primals, d_h) for backend in ("interpret_gpu", "reference")}
    for name, ours, ref in zip(("h", "d_x", "d_gate", "d_up"), got["interpret_gpu"], got["reference"]):
        assert ours.dtype == dtype
        err = rel_error(ours, ref)
        assert err <= TOL[dtype], f"{case} {name} {jnp.dtype(dtype).name}: rel. error {err:.2e}"


@pytest.mark.parametrize("case", ["odd", "wide"])
@DTYPES
def test_down_scatter_gradients_match_the_reference(case, dtype):
    _, row_weight, source, order, sizes, _, _, down = fused_inputs(case, dtype, seed=7)
    h = random_h(len(source), down.shape[2], dtype, seed=8)
    d_y = jnp.asarray(random_h(len(order), down.shape[1], dtype, seed=9), dtype)
    primals = (jnp.asarray(h, dtype), jnp.asarray(row_weight), jnp.asarray(down, dtype))

    def fn(backend, h, row_weight, down):
        return down_scatter(h, jnp.asarray(order), row_weight, jnp.asarray(sizes), down, backend=backend)

    got = {backend: vjp_of(functools.partial(fn, backend), primals, d_y) for backend in ("interpret_gpu", "reference")}
    for name, ours, ref in zip(("y", "d_h", "d_row_weight", "d_down"), got["interpret_gpu"], got["reference"]):
        err = rel_error(ours, ref)
        assert err <= TOL[dtype], f"{case} {name} {jnp.dtype(dtype).name}: rel. error {err:.2e}"
    assert not np.any(np.asarray(got["interpret_gpu"][2][sizes.sum() :])), "d_row_weight of tail rows is not 0"


def grouped_moe(x, weights, experts, gate, up, down, limit, *, backend):
    """`moe_experts` on the path `expert_path` picks for a call that never runs row by row (the fused kernels on a
    GPU backend, the grouped matmuls elsewhere)."""
    stacks = ExpertWeights(gate, up, down)
    return moe_experts(x, Routing(weights, experts), stacks, limit, expert_path(backend, stacks))


def dense_moe(x, weights, experts, gate, up, down, limit):
    return dense_expert_ffn(x, Routing(weights, experts), ExpertWeights(gate, up, down), limit)


def moe_args(case, dtype, seed):
    x, weights, experts, gate, up, down = random_case(*CASES[case], dtype, seed)
    return (
        jnp.asarray(x, dtype),
        jnp.asarray(weights),
        jnp.asarray(experts),
        *(jnp.asarray(w, dtype) for w in (gate, up, down)),
    )


@LIMITS
@pytest.mark.parametrize("case", sorted(CASES))
@DTYPES
def test_grouped_moe_matches_dense(limit, case, dtype):
    x, weights, experts, gate, up, down = moe_args(case, dtype, seed=11)
    ours = grouped_moe(x, weights, experts, gate, up, down, limit, backend="interpret_gpu")
    dense = dense_expert_ffn(
        x.astype(jnp.float32),
        Routing(jnp.where(experts < 0, 0.0, weights), experts),
        ExpertWeights(*(w.astype(jnp.float32) for w in (gate, up, down))),
        limit,
    )  # -1 wraps around there
    assert ours.dtype == dtype
    err = rel_error(ours, dense)
    assert err <= TOL[dtype], f"{case} {jnp.dtype(dtype).name}: rel. error {err:.2e}"


def test_grouped_moe_gradients_match_dense():
    """d/dx, d/d routing weights, d/d gate, up, down through the fused kernels' custom_vjp, fp32."""
    x, weights, experts, gate, up, down = moe_args("odd", jnp.float32, seed=12)
    experts = jnp.maximum(experts, 0)  # the dense baseline would wrap -1 around

    def loss(fn, x, weights, gate, up, down):
        return jnp.sum(jnp.sin(fn(x, weights, experts, gate, up, down, 0.9)))

    ours = jax.jit(
        jax.grad(functools.partial(loss, functools.partial(grouped_moe, backend="interpret_gpu")), argnums=range(5))
    )(x, weights, gate, up, down)
    dense = jax.jit(jax.grad(functools.partial(loss, dense_moe), argnums=range(5)))(x, weights, gate, up, down)
    for name, a, b in zip(["x", "weights", "gate", "up", "down"], ours, dense):
        assert rel_error(a, b) <= TOL[jnp.float32], f"d/d{name}: {rel_error(a, b):.2e}"


def test_gpu_backends_run_the_fused_kernels_and_the_reference_keeps_its_path():
    args = moe_args("odd", jnp.float32, seed=13)
    fused = str(jax.make_jaxpr(functools.partial(grouped_moe, limit=None, backend="interpret_gpu"))(*args))
    assert "gather_swiglu" in fused and "down_scatter" in fused and "grouped_matmul" not in fused
    reference = str(jax.make_jaxpr(functools.partial(grouped_moe, limit=None, backend="reference"))(*args))
    assert "gather_swiglu" not in reference and "ragged_dot" in reference


def test_unfused_path_on_the_gpu_kernels_matches_the_fused_one():
    """The GROUPED path (the pre-fusion path bench_moe compares against) with the grouped-matmul kernels."""
    x, weights, experts, *stacks = moe_args("odd", jnp.float32, seed=13)
    fused = grouped_moe(x, weights, experts, *stacks, 0.9, backend="interpret_gpu")
    unfused_path = ExpertPath(ExpertKernel.GROUPED, "interpret_gpu")
    unfused = moe_experts(x, Routing(weights, experts), ExpertWeights(*stacks), 0.9, unfused_path)
    assert rel_error(unfused, fused) <= TOL[jnp.float32]


def test_grouped_expert_ffn_skips_rows_of_no_expert():
    """The expert-parallel contract: rows whose expert is outside [0, E) give 0, the others are unweighted."""
    x, _, experts, gate, up, down = moe_args("odd", jnp.float32, seed=14)
    rows = jnp.repeat(x, experts.shape[1], axis=0)
    expert_R = experts.reshape(-1).at[3].set(gate.shape[0]).at[7].set(-2)
    stacks = ExpertWeights(gate, up, down)
    ours = grouped_expert_ffn(rows, expert_R, stacks, 0.9, expert_path("interpret_gpu", stacks))
    reference = grouped_expert_ffn(rows, expert_R, stacks, 0.9, expert_path("reference", stacks))
    assert rel_error(ours, reference) <= TOL[jnp.float32]
    assert not np.any(np.asarray(ours[jnp.array([3, 7])]))


@pytest.mark.parametrize(
    ("tokens", "shape", "exchange"),
    [(16, {"expert": 8}, "dense"), (16, {"expert": 8}, "ragged"), (3, {"tensor": 2, "expert": 4}, "dense")],
    ids=["all-to-all", "ragged-all-to-all", "replicated-tokens"],
)
def test_expert_parallel_with_the_fused_kernels_matches_dense(tokens, shape, exchange):
    """The GPU expert FFNs inside shard_map, on 8 virtual CPU devices (the ragged exchange emulated)."""
    top_k, num_experts, hidden, width = 2, 8, 32, 32
    x, weights, experts, gate, up, down = (
        jnp.asarray(a) for a in random_case(tokens, top_k, num_experts, hidden, width, jnp.float32, 15)
    )
    experts = jnp.maximum(experts, 0)  # the router always picks an expert
    mesh = make_mesh(shape)
    policy = ExecutionPolicy(kernel_backend="interpret_gpu", moe_exchange=exchange)
    with jax.set_mesh(mesh):
        y, _ = jax.jit(
            lambda x, weights, experts, gate, up, down: moe_parallel(
                x, Routing(weights, experts), ExpertWeights(gate, up, down), limit=0.9, mesh=mesh, policy=policy
            )
        )(x, weights, experts, gate, up, down)
    assert rel_error(y, dense_moe(x, weights, experts, gate, up, down, 0.9)) <= TOL[jnp.float32]


def test_gpu_kernels_lower_for_cuda_at_ling_flash_size():
    """8192 tokens, top-8 of 512 experts, hidden 4096, width 1024, bf16: forward and backward."""
    shape = jax.ShapeDtypeStruct
    args = (
        shape((8192, 4096), jnp.bfloat16),
        shape((8192, 8), jnp.float32),
        shape((8192, 8), jnp.int32),
        shape((512, 1024, 4096), jnp.bfloat16),
        shape((512, 1024, 4096), jnp.bfloat16),
        shape((512, 4096, 1024), jnp.bfloat16),
    )

    def loss(x, weights, experts, gate, up, down):
        return jnp.sum(grouped_moe(x, weights, experts, gate, up, down, 7.0, backend="pallas_gpu").astype(jnp.float32))

    text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 3, 4, 5)), *args).as_text()
    for kernel in ("gather_swiglu", "down_scatter", "grouped_matmul", "grouped_weight_grad"):
        assert kernel in text, kernel


ON_GPU = pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="the compiled Triton kernels need a GPU; they run on the device machine (pytest -m gpu)",
)


@jax.jit
def device_rel_error(ours, ref):
    """||ours - ref|| / ||ref|| in fp32 on the device (the full-size arrays stay there)."""
    diff = ours.astype(jnp.float32) - ref.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(diff * diff) / jnp.sum(ref.astype(jnp.float32) ** 2))


def moe_args_sized(tokens, top_k, num_experts, hidden, width, seed):
    """Device-drawn bf16 MoE inputs (x, weights, experts, gate, up, down); experts distinct per token."""
    keys = jax.random.split(jax.random.key(seed), 6)
    experts = jax.vmap(lambda k: jax.random.permutation(k, num_experts)[:top_k])(
        jax.random.split(keys[0], tokens)
    ).astype(jnp.int32)
    weights = jax.random.uniform(keys[1], (tokens, top_k), jnp.float32, 0.1, 1.0)
    x = jax.random.normal(keys[2], (tokens, hidden), jnp.bfloat16)
    gate, up = (jax.random.normal(k, (num_experts, width, hidden), jnp.bfloat16) * hidden**-0.5 for k in keys[3:5])
    down = jax.random.normal(keys[5], (num_experts, hidden, width), jnp.bfloat16) * width**-0.5
    return x, weights, experts, gate, up, down


@pytest.mark.gpu
@ON_GPU
@LIMITS
@pytest.mark.parametrize("case", sorted(CASES))
@DTYPES
def test_compiled_kernels_match_float64(limit, case, dtype):
    x, row_weight, source, order, sizes, gate, up, down = fused_inputs(case, dtype, seed=16)
    h = gathered_swiglu(x, source, sizes, gate, up, limit, dtype, "pallas_gpu")
    assert rel_error(h, float64_gather_swiglu(x, source, sizes, gate, up, limit)) <= TOL[dtype]
    y = down_scatter(
        h,
        jnp.asarray(order),
        jnp.asarray(row_weight),
        jnp.asarray(sizes),
        jnp.asarray(down, dtype),
        backend="pallas_gpu",
    )
    assert rel_error(y, float64_down_scatter(np.asarray(h, np.float32), order, row_weight, sizes, down)) <= TOL[dtype]


@pytest.mark.gpu
@ON_GPU
@pytest.mark.skipif(
    jax.device_count() < 2,
    reason="the native ragged all-to-all needs 2 or more GPUs (the nvidia-h200-x2 kind); one GPU was found",
)
def test_native_ragged_exchange_matches_the_dense_one_on_gpus(monkeypatch):
    """Expert parallelism over all GPUs with the fused kernels (fp32): the native ragged all-to-all against the
    dense exchange and against its all-gather emulation, value and gradients (the collective's transpose)."""
    ep = jax.device_count()
    tokens, top_k, num_experts, hidden, width = 192 * ep, 8, 16 * ep, 256, 128
    x, weights, experts, gate, up, down = moe_args_sized(tokens, top_k, num_experts, hidden, width, seed=19)
    primals = tuple(a.astype(jnp.float32) for a in (x, weights, gate, up, down))
    mesh = make_mesh({"expert": ep})

    def loss(exchange, x, weights, gate, up, down):
        y, _ = moe_parallel(
            x,
            Routing(weights, experts),
            ExpertWeights(gate, up, down),
            limit=7.0,
            mesh=mesh,
            policy=ExecutionPolicy(kernel_backend="pallas_gpu", moe_exchange=exchange),
        )
        return jnp.sum(y * jnp.cos(jnp.arange(hidden, dtype=jnp.float32))), y

    def run(exchange):
        with jax.set_mesh(mesh):
            return jax.jit(jax.value_and_grad(functools.partial(loss, exchange), argnums=range(5), has_aux=True))(
                *primals
            )

    (_, y_dense), grads_dense = run("dense")
    (_, y_ragged), grads_ragged = run("ragged")
    monkeypatch.setattr(expert_parallel, "has_ragged_all_to_all", lambda: False)
    (_, y_emulated), _ = run("ragged")
    assert device_rel_error(y_ragged, y_dense) <= 1e-5
    assert device_rel_error(y_emulated, y_dense) <= 1e-5
    for name, a, b in zip(["x", "weights", "gate", "up", "down"], grads_ragged, grads_dense):
        err = device_rel_error(a, b)
        assert err <= 1e-5, f"d/d{name}: rel. error {err:.2e}"


@pytest.mark.gpu
@ON_GPU
def test_compiled_moe_and_gradients_match_the_reference():
    """2048 tokens, top-8 of 64 experts, hidden 1024, width 256: the fused kernels in bf16 against the
    reference path in fp32 (a size XLA's ragged_dot fits), value and gradients."""
    tokens, top_k, num_experts, hidden, width = 2048, 8, 64, 1024, 256
    x, weights, experts, gate, up, down = moe_args_sized(tokens, top_k, num_experts, hidden, width, seed=17)

    def loss(backend, x, weights, gate, up, down):
        y = grouped_moe(x, weights, experts, gate, up, down, 7.0, backend=backend)
        return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(hidden, dtype=jnp.float32)))

    primals = (x, weights, gate, up, down)
    primals_f32 = tuple(a.astype(jnp.float32) for a in primals)
    y = grouped_moe(x, weights, experts, gate, up, down, 7.0, backend="pallas_gpu")
    y_ref = grouped_moe(*primals_f32[:2], experts, *primals_f32[2:], 7.0, backend="reference")
    assert device_rel_error(y, y_ref) <= TOL[jnp.bfloat16]
    ours = jax.jit(jax.grad(functools.partial(loss, "pallas_gpu"), argnums=range(5)))(*primals)
    ref = jax.jit(jax.grad(functools.partial(loss, "reference"), argnums=range(5)))(*primals_f32)
    for name, a, b in zip(["x", "weights", "gate", "up", "down"], ours, ref):
        err = device_rel_error(a, b)
        assert err <= TOL[jnp.bfloat16], f"d/d{name}: rel. error {err:.2e}"


@pytest.mark.gpu
@ON_GPU
def test_compiled_kernels_at_ling_flash_size_match_the_unfused_kernels():
    """8192 tokens, top-8 of 512 experts, hidden 4096, width 1024, bf16: the fused kernels against the plain
    grouped-matmul kernels on a materialised x[source] (which test_grouped_matmul checks at this size)."""
    x, weights, experts, gate, up, down = moe_args_sized(8192, 8, 512, 4096, 1024, seed=18)
    order, sizes = sort_by_expert(experts.reshape(-1), 512)
    source, row_weight = order // 8, weights.reshape(-1)[order]
    h = gather_swiglu(x, source, sizes, gate, up, 7.0, backend="pallas_gpu")
    x_RD = x[source]
    h_unfused = swiglu(
        grouped_matmul_gpu(x_RD, gate, sizes).astype(jnp.float32),
        grouped_matmul_gpu(x_RD, up, sizes).astype(jnp.float32),
        7.0,
    )
    assert device_rel_error(h, h_unfused) <= TOL[jnp.bfloat16]
    y = down_scatter(h, order, row_weight, sizes, down, backend="pallas_gpu")
    y_sorted = row_weight[:, None] * grouped_matmul_gpu(h, down, sizes).astype(jnp.float32)
    y_unfused = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
    assert device_rel_error(y, y_unfused) <= TOL[jnp.bfloat16]


@pytest.mark.parametrize("min_block_m", [16, 64], ids=["shrinking", "fixed"])
def test_fused_kernels_partial_row_tiles_shrink_to_the_rows_they_hold(min_block_m):
    """Experts whose last 64-row tile holds 6, 26, 36, 16 and 64 rows (tiles of 16, 32, 64, 16, 64), an empty
    expert, a tail of rows past the experts."""
    r = np.random.default_rng(min_block_m)
    sizes = np.asarray([70, 90, 100, 16, 0, 64], np.int32)
    rows, tokens, hidden, width = sizes.sum() + 9, 150, 48, 40
    x, gate, up, down = (
        np.asarray(jnp.asarray(r.normal(size=shape), jnp.float32))
        for shape in ((tokens, hidden), (6, width, hidden), (6, width, hidden), (6, hidden, width))
    )
    source, order = r.integers(0, tokens, rows).astype(np.int32), r.permutation(rows).astype(np.int32)
    row_weight = r.uniform(0.1, 1.0, rows).astype(np.float32)
    args = {"block_m": 64, "block_n": 16, "block_k": 16, "min_block_m": min_block_m, "interpret": True}
    h = gather_swiglu_gpu(
        jnp.asarray(x), jnp.asarray(source), jnp.asarray(sizes), jnp.asarray(gate), jnp.asarray(up), limit=0.9, **args
    )
    assert rel_error(h, float64_gather_swiglu(x, source, sizes, gate, up, 0.9)) <= TOL[jnp.float32]
    y = down_scatter_gpu(h, jnp.asarray(order), jnp.asarray(row_weight), jnp.asarray(sizes), jnp.asarray(down), **args)
    assert rel_error(y, float64_down_scatter(np.asarray(h), order, row_weight, sizes, down)) <= TOL[jnp.float32]
