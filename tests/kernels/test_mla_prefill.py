"""Flash-style expanded MLA prefill (query chunks x key blocks, skipped blocks) and its GPU kernel (segments of
expanded keys, Pallas interpret mode on the CPU; CUDA lowering; compiled on the GPU) vs a float64 dense softmax."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import gpu_test, lower_for_cuda, rel_error

from ling_jax import ExecutionPolicy, LingConfig, LingForCausalLM
from ling_jax.presets import TINY
from pallas_kernels.mla import mla_prefill
from pallas_kernels.mla.ops import kernel
from pallas_kernels.mla.reference import flash_expanded_attention
from pallas_kernels.mla.tuned import PREFILL
from pallas_kernels.tuning import lookup

flash_expanded_attention_gpu = kernel("mla_prefill", "gpu_triton")

HEADS, NOPE, ROPE, VALUE, LATENT = 3, 12, 8, 10, 24
KERNEL_DIMS = dict(nope=32, value=32, rope=16)  # the GPU kernel's: powers of two, >= 16 (Triton's dot)


def float64_expanded(q_nope, q_pe, latent, query_slots, key_valid, w_uk, w_uv, scale):
    c_kv, k_pe = latent[..., :LATENT], latent[..., LATENT:]
    k_nope = np.einsum("bsr,hnr->bshn", c_kv, w_uk)
    v = np.einsum("bsr,hvr->bshv", c_kv, w_uv)
    scores = scale * (np.einsum("bthn,bshn->bhts", q_nope, k_nope) + np.einsum("bthp,bsp->bhts", q_pe, k_pe))
    visible = (np.arange(latent.shape[1])[None, None, :] <= query_slots[:, :, None]) & key_valid[:, None, :]
    scores = np.where(visible[:, None], scores, -np.inf)
    peak = np.max(scores, axis=-1, keepdims=True)
    weights = np.where(visible[:, None], np.exp(scores - np.where(np.isfinite(peak), peak, 0)), 0)
    total = weights.sum(-1, keepdims=True)
    return np.einsum("bhts,bshv->bthv", weights / np.where(total > 0, total, 1), v)


def random_case(dtype, seed, nope=NOPE, value=VALUE, rope=ROPE, length=45, slots=100, cached=30, left_pad=0):
    """Inputs (in dtype, as passed to the attention) and the float64 reference on their rounded values.
    Row 0: a chunk appended after `cached` cache slots, the first left_pad of them invalid (causal with an
    offset); row 1: ragged, one pad query."""
    r = np.random.default_rng(seed)
    batch = 2
    q_nope = r.normal(size=(batch, length, HEADS, nope))
    q_pe = r.normal(size=(batch, length, HEADS, rope))
    latent = r.normal(size=(batch, slots, LATENT + rope))
    w_uk = r.normal(size=(HEADS, nope, LATENT)) / np.sqrt(LATENT)
    w_uv = r.normal(size=(HEADS, value, LATENT)) / np.sqrt(LATENT)
    query_slots = np.stack([cached + np.arange(length), np.r_[-1, np.arange(length - 1) * 2]])
    key_valid = np.stack(
        [(np.arange(slots) < cached + length) & (np.arange(slots) >= left_pad), r.uniform(size=slots) < 0.7]
    )
    rounded = [
        np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64) for x in (q_nope, q_pe, latent, w_uk, w_uv)
    ]
    ref = float64_expanded(rounded[0], rounded[1], rounded[2], query_slots, key_valid, rounded[3], rounded[4], 0.2)
    args = (
        *(jnp.asarray(x, dtype) for x in rounded[:3]),
        jnp.asarray(query_slots, jnp.int32),
        jnp.asarray(key_valid),
        *(jnp.asarray(x, dtype) for x in rounded[3:]),
    )
    return args, ref


def assert_matches(out, ref, dtype, tol, what):
    assert out.shape == ref.shape and out.dtype == dtype
    err = float(np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref))
    assert err <= tol, f"{what}: rel. error {err:.2e}"
    np.testing.assert_array_equal(np.asarray(out[1, 0], np.float64), 0.0)  # the pad query sees nothing


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("blocks", [(16, 32), (64, 7), (2048, 512)])
def test_flash_prefill_matches_dense_float64(dtype, tol, blocks):
    args, ref = random_case(dtype, seed=blocks[0] + blocks[1])
    out = flash_expanded_attention(*args, scale=0.2, query_block=blocks[0], key_block=blocks[1])
    assert_matches(out, ref, dtype, tol, f"blocks {blocks}")


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("segment, block_q, block_k", [(32, 16, 16), (128, 64, 32), (4096, 64, 64)])
def test_gpu_kernel_matches_dense_float64(dtype, tol, segment, block_q, block_k):
    """The Pallas (Triton) segment kernel in interpret mode: several segments merged, a padded last segment."""
    args, ref = random_case(dtype, seed=segment + block_k, **KERNEL_DIMS)
    tiles = dataclasses.replace(lookup(PREFILL, dtype=dtype), segment=segment, block_q=block_q, block_k=block_k)
    out = flash_expanded_attention_gpu(*args, scale=0.2, tiles=tiles, interpret=True)
    assert_matches(out, ref, dtype, tol, f"segment {segment}, blocks {block_q}x{block_k}")


def test_gpu_kernel_over_a_long_cache_stops_at_the_last_visible_slot():
    """A cache of 1000 slots in segments of 32, the last visible slot near 90: the segments past it are skipped
    and the result is still exact."""
    args, ref = random_case(jnp.float32, seed=9, slots=1000, **KERNEL_DIMS)
    tiles = dataclasses.replace(lookup(PREFILL, dtype=jnp.float32), segment=32, block_q=16, block_k=16)
    out = flash_expanded_attention_gpu(*args, scale=0.2, tiles=tiles, interpret=True)
    assert_matches(out, ref, jnp.float32, 1e-4, "long cache")


def test_gpu_kernel_refuses_dims_triton_cannot_multiply():
    args, _ = random_case(jnp.float32, seed=1, nope=16, value=16, rope=8)
    with pytest.raises(ValueError, match="powers of two"):
        flash_expanded_attention_gpu(*args, scale=0.2, interpret=True)


def test_gpu_kernel_lowers_for_cuda_at_ling_width():
    shape = jax.ShapeDtypeStruct
    batch, length, slots, heads = 1, 2048, 8192, 64
    args = (
        shape((batch, length, heads, 128), jnp.bfloat16),
        shape((batch, length, heads, 64), jnp.bfloat16),
        shape((batch, slots, 576), jnp.bfloat16),
        shape((batch, length), jnp.int32),
        shape((batch, slots), jnp.bool_),
        shape((heads, 128, 512), jnp.bfloat16),
        shape((heads, 128, 512), jnp.bfloat16),
    )
    lowered = lower_for_cuda(functools.partial(flash_expanded_attention_gpu, scale=0.07), *args)
    assert "mla_prefill_segment" in lowered.as_text()


@gpu_test("the compiled Triton kernel")
def test_compiled_gpu_kernel_matches_dense_float64():
    args, ref = random_case(jnp.bfloat16, seed=5, length=300, slots=700, **KERNEL_DIMS)
    out = flash_expanded_attention_gpu(
        *args, scale=0.2, tiles=dataclasses.replace(lookup(PREFILL, dtype=jnp.bfloat16), segment=256)
    )
    assert_matches(out, ref, jnp.bfloat16, 2e-2, "compiled")


def _runs_prefill_kernel(fn, *args) -> bool:
    return "mla_prefill_segment" in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize(
    "dims, kernel",
    [(KERNEL_DIMS, True), (dict(nope=NOPE, value=VALUE, rope=ROPE), False)],
    ids=["kernel-dims", "other-dims"],
)
@pytest.mark.parametrize("backend", ["interpret_gpu", "reference", "interpret_tpu"])
def test_mla_prefill_op_picks_the_kernel_where_it_fits(backend, dims, kernel):
    """The GPU backends run the Triton kernel for power-of-two head dims >= 16 and the jnp flash path otherwise;
    every backend matches float64."""
    args, ref = random_case(jnp.float32, seed=17, **dims)
    op = functools.partial(mla_prefill, scale=0.2, backend=backend)
    assert _runs_prefill_kernel(op, *args) == (kernel and backend == "interpret_gpu")
    assert_matches(op(*args), ref, jnp.float32, 1e-4, f"{backend}, {dims}")


def test_mla_prefill_kernel_gradient_is_the_flash_paths():
    args, _ = random_case(jnp.float32, seed=23, **KERNEL_DIMS)
    cotangent = jnp.asarray(np.random.default_rng(2).normal(size=(2, 45, HEADS, KERNEL_DIMS["value"])), jnp.float32)

    def grads(backend):
        loss = lambda q_nope, latent, w_uv: jnp.sum(
            cotangent
            * mla_prefill(  # noqa: E731
                q_nope, args[1], latent, args[3], args[4], args[5], w_uv, scale=0.2, backend=backend
            )
        )
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(args[0], args[2], args[6])

    for kernel_grad, flash_grad in zip(grads("interpret_gpu"), grads("reference")):
        assert rel_error(kernel_grad, flash_grad) <= 1e-5


KERNEL_TINY = {**TINY, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16}


def _prefill_logits(backend: str):
    config = LingConfig.from_dict(KERNEL_TINY)
    model = LingForCausalLM(config, rngs=nnx.Rngs(3), dtype=jnp.float32, policy=ExecutionPolicy(kernel_backend=backend))
    ids = jnp.asarray(np.random.default_rng(8).integers(2, config.vocab_size, (2, 13)))
    mask = jnp.asarray(np.r_[[[0, 0] + [1] * 11], [[1] * 13]].astype(bool))  # row 0 left-padded
    out = model(ids, cache=model.init_cache(2, 20), attention_mask=mask)
    return out.logits, out.cache


@gpu_test("the compiled Triton kernel in the model")
def test_compiled_model_prefill_with_kernel_equals_reference():
    """fp32 with full-precision XLA products (a GPU's default runs fp32 matmuls in tf32), as the kernels do."""
    with jax.default_matmul_precision("float32"):
        logits, _ = _prefill_logits("pallas_gpu")
        ref_logits, _ = _prefill_logits("reference")
    assert rel_error(logits, ref_logits) <= 1e-4
