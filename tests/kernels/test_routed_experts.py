"""Routed experts of a few tokens (`pallas_kernels.moe.routed_experts`): the GPU kernels (Pallas interpret mode
on the CPU, compiled on the device machine) and the jnp reference against a float64 loop over tokens and
slots; gradients; the decode dispatch in `local_moe`; lowering for CUDA from the CPU."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import lower_for_cuda, rel_error

from ling_jax.layers import SplitSum, add_rms_norm
from ling_jax.moe.experts import SharedExpert, dense_expert_ffn, local_moe, swiglu_ffn
from ling_jax.policy import ExecutionPolicy
from pallas_kernels.moe import routed_experts, tuned
from pallas_kernels.moe.ops import ExpertWeights, Routing
from pallas_kernels.moe.tuned import ROW_PATH_MAX_ROWS

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
BACKENDS = ["interpret_gpu", "reference"]


def random_case(tokens, top_k, num_experts, hidden, width, dtype, seed, invalid=False):
    """x, routing weights, experts (distinct per token; with `invalid`, some slots hold -1 or E), gate, up,
    down: as float32 numpy rounded to dtype, no zeros."""
    r = np.random.default_rng(seed)
    rounded = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # noqa: E731
    experts = np.stack([r.permutation(num_experts)[:top_k] for _ in range(tokens)]).astype(np.int32)
    if invalid:
        experts[0, -1], experts[-1, 0] = -1, num_experts
    return (
        rounded(r.normal(size=(tokens, hidden))),
        r.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32),
        experts,
        rounded(r.normal(size=(num_experts, width, hidden)) / hidden**0.5),
        rounded(r.normal(size=(num_experts, width, hidden)) / hidden**0.5),
        rounded(r.normal(size=(num_experts, hidden, width)) / width**0.5),
    )


def float64_ffn(x, gate, up, down, limit):
    """One SwiGLU expert on one token in float64."""
    g, u = gate.astype(np.float64) @ x, up.astype(np.float64) @ x
    activated = g / (1 + np.exp(-g))
    if limit is not None:
        activated, u = np.minimum(activated, limit), np.clip(u, -limit, limit)
    return down.astype(np.float64) @ (activated * u)


def float64_loop(x, weights, experts, gate, up, down, limit, shared=None, shared_limit=None):
    """Token by token, slot by slot, in float64; experts outside [0, E) are skipped; `shared` (gate, up, down)
    is added with weight 1."""
    out = np.zeros(x.shape)
    for t in range(x.shape[0]):
        for k, e in enumerate(experts[t]):
            if 0 <= e < gate.shape[0]:
                out[t] += weights[t, k] * float64_ffn(x[t], gate[e], up[e], down[e], limit)
        if shared is not None:
            out[t] += float64_ffn(x[t], *shared, shared_limit)
    return out


def random_shared(hidden, width, seed):
    r = np.random.default_rng(seed)
    return (
        r.normal(size=(width, hidden)) / hidden**0.5,
        r.normal(size=(width, hidden)) / hidden**0.5,
        r.normal(size=(hidden, width)) / width**0.5,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("limit", [None, 0.7], ids=["no-limit", "limit"])
@pytest.mark.parametrize(
    "shape", [(1, 8, 16, 64, 32), (5, 3, 7, 48, 40), (3, 1, 4, 130, 24)], ids=["decode-1", "odd", "top-1"]
)
def test_matches_float64_loop_fp32(backend, limit, shape):
    case = random_case(*shape, jnp.float32, seed=sum(shape), invalid=shape[1] > 1)
    ours = routed_experts(*(jnp.asarray(a) for a in case), limit, backend=backend)
    assert ours.dtype == jnp.float32
    assert rel_error(ours, float64_loop(*case, limit)) <= TOL[jnp.float32]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shared_limit", [None, 0.4], ids=["shared", "shared-limit"])
@pytest.mark.parametrize("shape", [(1, 8, 16, 64, 32), (5, 3, 7, 48, 40)], ids=["decode-1", "odd"])
def test_shared_expert_rows_match_float64_loop(backend, shared_limit, shape):
    """The shared expert as one more row per token (its own clip), invalid routed slots included."""
    case = random_case(*shape, jnp.float32, seed=sum(shape) + 1, invalid=True)
    shared = tuple(a.astype(np.float32) for a in random_shared(shape[3], shape[4], seed=shape[0]))
    ours = routed_experts(
        *(jnp.asarray(a) for a in case),
        0.7,
        shared=tuple(map(jnp.asarray, shared)),
        shared_limit=shared_limit,
        backend=backend,
    )
    assert rel_error(ours, float64_loop(*case, 0.7, shared, shared_limit)) <= TOL[jnp.float32]


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_expert_gradients_match_the_dense_path(backend):
    x, weights, experts, gate, up, down = (jnp.asarray(a) for a in random_case(3, 2, 5, 24, 16, jnp.float32, 9))
    shared = tuple(jnp.asarray(a, jnp.float32) for a in random_shared(24, 16, seed=4))

    def loss(fn, x, weights, gate, up, down, shared):
        return jnp.sum(jnp.sin(fn(x, weights, gate, up, down, shared)))

    def ours(x, weights, gate, up, down, shared):
        return routed_experts(
            x, weights, experts, gate, up, down, 0.9, shared=shared, shared_limit=0.5, backend=backend
        )

    def dense(x, weights, gate, up, down, shared):
        routed = dense_expert_ffn(x, Routing(weights, experts), ExpertWeights(gate, up, down), 0.9)
        return routed + swiglu_ffn(x, *shared, 0.5)

    got, expected = (
        jax.jit(jax.grad(functools.partial(loss, fn), argnums=range(6)))(x, weights, gate, up, down, shared)
        for fn in (ours, dense)
    )
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        assert rel_error(a, b) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16(backend):
    case = random_case(2, 8, 32, 256, 64, jnp.bfloat16, seed=3)
    args = [
        jnp.asarray(a, jnp.bfloat16) if a.dtype == np.float32 and i != 1 else jnp.asarray(a) for i, a in enumerate(case)
    ]
    ours = routed_experts(*args, 7.0, backend=backend)
    assert ours.dtype == jnp.bfloat16
    assert rel_error(ours, float64_loop(*case, 7.0)) <= TOL[jnp.bfloat16]


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_match_the_dense_path(backend):
    """Gradients for x, the routing weights and the three expert weights against the one-hot dense FFN."""
    x, weights, experts, gate, up, down = (jnp.asarray(a) for a in random_case(3, 2, 5, 24, 16, jnp.float32, 9))

    def loss(fn, x, weights, gate, up, down):
        return jnp.sum(jnp.sin(fn(x, weights, experts, gate, up, down, 0.9)))

    def dense_path(x, weights, experts, gate, up, down, limit):
        return dense_expert_ffn(x, Routing(weights, experts), ExpertWeights(gate, up, down), limit)

    ours, dense = (
        jax.jit(jax.grad(functools.partial(loss, fn), argnums=range(5)))(x, weights, gate, up, down)
        for fn in (functools.partial(routed_experts, backend=backend), dense_path)
    )
    for name, a, b in zip(["x", "weights", "gate", "up", "down"], ours, dense):
        assert rel_error(a, b) <= 1e-5, f"d/d{name}: {rel_error(a, b):.2e}"


def test_local_moe_takes_the_row_path_for_few_tokens():
    """On a GPU backend, up to ROW_PATH_MAX_ROWS rows run the row kernels; either way the result is the
    grouped reference's."""
    for tokens in (1, ROW_PATH_MAX_ROWS // 4, ROW_PATH_MAX_ROWS // 4 + 1):
        x, weights, experts, gate, up, down = (
            jnp.asarray(a) for a in random_case(tokens, 4, 8, 32, 16, jnp.float32, tokens)
        )
        args = (x, Routing(weights, experts), ExpertWeights(gate, up, down))
        traced = jax.jit(
            functools.partial(local_moe, limit=2.0, policy=ExecutionPolicy(kernel_backend="interpret_gpu"))
        ).trace(*args)
        assert ("expert_swiglu_rows" in str(traced.jaxpr)) == (tokens * 4 <= ROW_PATH_MAX_ROWS)
        grouped = jax.jit(functools.partial(local_moe, limit=2.0, policy=ExecutionPolicy(kernel_backend="reference")))(
            *args
        )
        assert rel_error(traced.lower().compile()(*args), grouped) <= 1e-5


@pytest.mark.parametrize("tokens", [1, ROW_PATH_MAX_ROWS // 4 + 1])
@pytest.mark.parametrize("shared_width", [16, 24], ids=["same-width", "other-width"])
def test_local_moe_with_the_shared_expert(tokens, shared_width):
    """The shared expert joins the row kernels when it has the routed width (one launch pair, no separate
    shared-expert ops); otherwise, and on the grouped path, it is added after. Always == reference."""
    x, weights, experts, gate, up, down = (
        jnp.asarray(a) for a in random_case(tokens, 4, 8, 32, 16, jnp.float32, tokens)
    )
    shared = SharedExpert(*(jnp.asarray(a, jnp.float32) for a in random_shared(32, shared_width, seed=7)), 0.6)
    args = (x, Routing(weights, experts), ExpertWeights(gate, up, down))
    run = functools.partial(local_moe, limit=2.0, shared=shared)
    traced = jax.jit(functools.partial(run, policy=ExecutionPolicy(kernel_backend="interpret_gpu"))).trace(*args)
    in_rows = tokens * 4 <= ROW_PATH_MAX_ROWS and shared_width == 16
    assert ("expert_down_combine" in str(traced.jaxpr.eqns[-1])) == in_rows  # the kernels' output is the result
    ours = traced.lower().compile()(*args)
    reference = jax.jit(functools.partial(run, policy=ExecutionPolicy(kernel_backend="reference")))(*args)
    expected = dense_expert_ffn(*args, 2.0) + swiglu_ffn(x, *shared.weights, shared.limit)
    assert rel_error(ours, expected) <= 1e-5 and rel_error(reference, expected) <= 1e-5


def test_local_moe_split_sums_add_up_in_the_next_norm(monkeypatch):
    """split_sums: the down kernel's 3 splits of the width (K steps of 8 over 24: one each) come back unsummed, [3,
    T, D] fp32, and the norm after the layer adds them (`layers.add_rms_norm` of a `SplitSum`, the norm kernel's
    partials form): the reference's output and norm; the reference path gives its sum as one split."""
    table = {
        key: dataclasses.replace(entry, params=dataclasses.replace(entry.params, block_k=8, splits=3))
        for key, entry in tuned.ROUTED_DOWN.items()
    }
    monkeypatch.setattr(tuned, "ROUTED_DOWN", table)
    jax.clear_caches()
    x, weights, experts, gate, up, down = (jnp.asarray(a) for a in random_case(2, 4, 8, 32, 24, jnp.float32, 4))
    shared = SharedExpert(*(jnp.asarray(a, jnp.float32) for a in random_shared(32, 24, seed=5)), 0.6)
    args = (x, Routing(weights, experts), ExpertWeights(gate, up, down))
    outs = {
        backend: jax.jit(
            functools.partial(
                local_moe, limit=2.0, shared=shared, split_sums=True, policy=ExecutionPolicy(kernel_backend=backend)
            )
        )(*args)
        for backend in ("interpret_gpu", "reference")
    }
    jax.clear_caches()
    assert outs["interpret_gpu"].shape == (3, 2, 32) and outs["interpret_gpu"].dtype == jnp.float32
    assert outs["reference"].shape == (1, 2, 32)
    expected = dense_expert_ffn(*args, 2.0) + swiglu_ffn(x, *shared.weights, shared.limit)
    assert rel_error(jnp.sum(outs["interpret_gpu"], axis=0), expected) <= 1e-5
    residual = jnp.asarray(np.random.default_rng(6).normal(size=(2, 32)), jnp.float32)
    norm = {"weight": jnp.asarray(np.random.default_rng(7).uniform(0.5, 1.5, 32), jnp.float32)}
    want = add_rms_norm(norm, residual, expected, 1e-6)
    for backend, out in outs.items():
        policy = ExecutionPolicy(kernel_backend=backend)
        for ours, theirs in zip(add_rms_norm(norm, residual, SplitSum(out), 1e-6, policy), want, strict=True):
            assert rel_error(ours, theirs) <= 1e-5, backend


def test_gpu_kernels_lower_for_cuda():
    """Flash-sized decode shapes (one token, top-8 of 512 experts, hidden 4096, width 1024)."""
    shape = jax.ShapeDtypeStruct
    args = (
        shape((1, 4096), jnp.bfloat16),
        shape((1, 8), jnp.float32),
        shape((1, 8), jnp.int32),
        shape((512, 1024, 4096), jnp.bfloat16),
        shape((512, 1024, 4096), jnp.bfloat16),
        shape((512, 4096, 1024), jnp.bfloat16),
    )
    lowered = lower_for_cuda(functools.partial(routed_experts, limit=7.0, backend="pallas_gpu"), *args)
    text = lowered.as_text()
    assert "expert_swiglu_rows" in text and "expert_down_combine" in text


@pytest.mark.gpu
@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="the compiled Triton kernels need a GPU; they run on the device machine (pytest -m gpu)",
)
@pytest.mark.parametrize("tokens", [1, 8])
def test_compiled_gpu_kernels_at_decode_size(tokens):
    """Ling-3.1-flash shapes, bf16: weights drawn on the device (3 x 512 x 4096 x 1024 values); the float64
    loop runs on the picked experts only."""
    num_experts, hidden, width, top_k = 512, 4096, 1024, 8
    r = np.random.default_rng(tokens)
    experts = np.stack([r.permutation(num_experts)[:top_k] for _ in range(tokens)]).astype(np.int32)
    weights = r.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32)
    keys = jax.random.split(jax.random.key(tokens), 4)
    x = jax.random.normal(keys[0], (tokens, hidden), jnp.bfloat16)
    gate, up = (jax.random.normal(k, (num_experts, width, hidden), jnp.bfloat16) * hidden**-0.5 for k in keys[1:3])
    down = jax.random.normal(keys[3], (num_experts, hidden, width), jnp.bfloat16) * width**-0.5
    ours = routed_experts(x, jnp.asarray(weights), jnp.asarray(experts), gate, up, down, 7.0, backend="pallas_gpu")
    picked, local = np.unique(experts, return_inverse=True)
    host = [np.asarray(w[jnp.asarray(picked)], np.float32) for w in (gate, up, down)]
    expected = float64_loop(np.asarray(x, np.float32), weights, local.reshape(experts.shape), *host, 7.0)
    assert rel_error(ours, expected) <= TOL[jnp.bfloat16]
