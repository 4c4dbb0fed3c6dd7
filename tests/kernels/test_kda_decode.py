"""KDA decode-step kernels (GPU and TPU, Pallas interpret mode on the CPU) vs the float64 recurrence;
lowering for TPU and CUDA from the CPU; prefill then kernel steps == longer prefill
(the model's decode with the kernels: test_model_kernels.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import l2, lower_for_cuda, rel_error
from np_reference import kda_recurrence

from pallas_kernels.kda import kda_chunked, kda_decode_step
from pallas_kernels.kda.ops import kernel
from pallas_kernels.kda.tuned import DecodeGpuTiles

BACKENDS = ["interpret_gpu", "interpret_tpu", "reference"]
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}
kda_decode_step_gpu = kernel("kda_decode_step", "gpu_triton")
kda_decode_step_tpu = kernel("kda_decode_step", "tpu_mosaic")
GPU_VARIANTS = {  # kda_decode_step_gpu keywords at the test shapes (K 16 or 32)
    "narrow_v_blocks": dict(tiles=DecodeGpuTiles(block_v=8, num_warps=4)),
    "two_warps": dict(tiles=DecodeGpuTiles(block_v=16, num_warps=2)),
}
FULL_SIZE_GPU_VARIANTS = {  # the same at K = V = 128 (benchmarks/kda.py's candidates)
    "default": {},
    "v_block_32_two_warps": dict(tiles=DecodeGpuTiles(block_v=32, num_warps=2)),
    "v_block_16_one_warp": dict(tiles=DecodeGpuTiles(block_v=16, num_warps=1)),
}


def random_step(batch, heads, key_dim, value_dim, dtype, seed):
    r = np.random.default_rng(seed)
    rounded = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # noqa: E731
    q = rounded(r.normal(size=(batch, heads, key_dim)))
    k = rounded(r.normal(size=(batch, heads, key_dim)))
    v = rounded(r.normal(size=(batch, heads, value_dim)))
    g = -5.0 * r.uniform(size=(batch, heads, key_dim)).astype(np.float32)
    beta = r.uniform(0.05, 1.0, size=(batch, heads)).astype(np.float32)
    state = r.normal(size=(batch, heads, key_dim, value_dim)).astype(np.float32)
    return q, k, v, g, beta, state


def assert_step_matches_float64_recurrence(step, dtype, shape):
    """step(q, k, v, g, beta, state) -> (o, new state) on a random step, against the float64 recurrence."""
    q, k, v, g, beta, state = random_step(*shape, dtype, seed=sum(shape))
    o_ref, s_ref = kda_recurrence(l2(q)[:, None], l2(k)[:, None], v[:, None], g[:, None], beta[:, None], state)
    o, new_state = step(
        jnp.asarray(q, dtype),
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(g),
        jnp.asarray(beta),
        jnp.asarray(state),
    )
    assert o.dtype == dtype and new_state.dtype == jnp.float32
    assert rel_error(o, o_ref[:, 0]) <= TOL[dtype], rel_error(o, o_ref[:, 0])
    assert rel_error(new_state, s_ref) <= 1e-5, rel_error(new_state, s_ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 3, 16, 16), (3, 2, 32, 64)])
def test_step_matches_float64_recurrence(backend, dtype, shape):
    assert_step_matches_float64_recurrence(functools.partial(kda_decode_step, backend=backend), dtype, shape)


@pytest.mark.parametrize("variant", GPU_VARIANTS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 3, 16, 16), (3, 2, 32, 64)])
def test_gpu_kernel_variants_match_float64_recurrence(variant, dtype, shape):
    step = functools.partial(kda_decode_step_gpu, scale=shape[2] ** -0.5, interpret=True, **GPU_VARIANTS[variant])
    assert_step_matches_float64_recurrence(step, dtype, shape)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_then_kernel_steps_equals_longer_prefill(backend):
    r = np.random.default_rng(9)
    batch, length, heads, dim = 2, 69, 2, 16
    q, k, v = (jnp.asarray(r.normal(size=(batch, length, heads, dim)), jnp.float32) for _ in range(3))
    g = jnp.asarray(-5.0 * r.uniform(size=(batch, length, heads, dim)), jnp.float32)
    beta = jnp.asarray(r.uniform(size=(batch, length, heads)), jnp.float32)
    o_all, s_all = jax.jit(kda_chunked)(q, k, v, g, beta)
    _, state = jax.jit(kda_chunked)(q[:, :65], k[:, :65], v[:, :65], g[:, :65], beta[:, :65])
    for t in range(65, 69):
        o_t, state = kda_decode_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, backend=backend)
        assert rel_error(o_t, o_all[:, t]) <= 1e-5
    assert rel_error(state, s_all) <= 1e-5


def _abstract_step(batch=4, heads=64, dim=128):
    shape = jax.ShapeDtypeStruct
    return (
        shape((batch, heads, dim), jnp.bfloat16),
        shape((batch, heads, dim), jnp.bfloat16),
        shape((batch, heads, dim), jnp.bfloat16),
        shape((batch, heads, dim), jnp.float32),
        shape((batch, heads), jnp.float32),
        shape((batch, heads, dim, dim), jnp.float32),
    )


def test_tpu_kernel_lowers_for_tpu():
    lowered = (
        jax.jit(functools.partial(kda_decode_step_tpu, scale=128**-0.5))
        .trace(*_abstract_step())
        .lower(lowering_platforms=("tpu",))
    )
    assert "tpu_custom_call" in lowered.as_text()


@pytest.mark.parametrize("variant", FULL_SIZE_GPU_VARIANTS)
def test_gpu_kernel_lowers_for_cuda(variant):
    step = functools.partial(kda_decode_step_gpu, scale=128**-0.5, **FULL_SIZE_GPU_VARIANTS[variant])
    lowered = lower_for_cuda(step, *_abstract_step(batch=64))
    assert "kda_decode_step" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="the compiled Triton kernel needs a GPU; it runs on the device machine (pytest -m gpu)",
)
@pytest.mark.parametrize("batch", [1, 64])
def test_compiled_gpu_kernel_full_size(batch):
    q, k, v, g, beta, state = random_step(batch, 64, 128, 128, jnp.bfloat16, seed=batch)
    o_ref, s_ref = kda_recurrence(l2(q)[:, None], l2(k)[:, None], v[:, None], g[:, None], beta[:, None], state)
    o, new_state = kda_decode_step(
        jnp.asarray(q, jnp.bfloat16),
        jnp.asarray(k, jnp.bfloat16),
        jnp.asarray(v, jnp.bfloat16),
        jnp.asarray(g),
        jnp.asarray(beta),
        jnp.asarray(state),
        backend="pallas_gpu",
    )
    assert rel_error(o, o_ref[:, 0]) <= 2e-2 and rel_error(new_state, s_ref) <= 1e-5
