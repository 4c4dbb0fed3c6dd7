"""The absorbed-MLA weight products (`pallas_kernels.mla.absorb_query`, `expand_output`): the GPU kernels for a
few query rows (Pallas interpret mode on the CPU, compiled on the device machine) and the jnp reference against
float64 numpy; gradients; lowering for CUDA at Ling-3.1-flash size."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import lower_for_cuda, rel_error

from pallas_kernels.mla.gpu_triton import ROWS
from pallas_kernels.mla.ops import absorb_query, expand_output

BACKENDS = ["interpret_gpu", "reference"]


def random_case(rows, heads, nope, value, rank, dtype, seed):
    r = np.random.default_rng(seed)
    rounded = lambda shape: jnp.asarray(r.normal(size=shape), dtype)  # noqa: E731
    return rounded((rows, heads, nope)), rounded((rows, heads, rank)), rounded((heads, nope + value, rank))


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, ROWS, ROWS + 4], ids=["one", "three", "most", "above"])
def test_matches_float64(rows, dtype, backend):
    heads, nope, value, rank = 4, 16, 8, 64
    q_nope, o_latent, kv_b = random_case(rows, heads, nope, value, rank, dtype, seed=rows)
    q_latent = absorb_query(q_nope, kv_b, backend=backend)
    out = expand_output(o_latent, kv_b, nope, backend=backend)
    assert q_latent.dtype == jnp.float32 and q_latent.shape == (rows, heads, rank)
    assert out.dtype == jnp.float32 and out.shape == (rows, heads, value)
    assert rel_error(q_latent, np.einsum("mhn,hnr->mhr", f64(q_nope), f64(kv_b)[:, :nope])) <= 1e-6
    assert rel_error(out, np.einsum("mhr,hvr->mhv", f64(o_latent), f64(kv_b)[:, nope:])) <= 1e-6


def test_kernels_run_for_few_rows_only():
    q_nope, o_latent, kv_b = random_case(ROWS + 1, 2, 16, 16, 32, jnp.float32, seed=0)
    for rows, expected in ((ROWS, True), (ROWS + 1, False)):
        text = str(jax.make_jaxpr(functools.partial(absorb_query, backend="interpret_gpu"))(q_nope[:rows], kv_b))
        assert ("mla_absorb_query" in text) == expected
        text = str(
            jax.make_jaxpr(functools.partial(expand_output, nope=16, backend="interpret_gpu"))(o_latent[:rows], kv_b)
        )
        assert ("mla_expand_output" in text) == expected


def test_gradients_match_the_reference():
    q_nope, o_latent, kv_b = random_case(2, 3, 16, 16, 32, jnp.float32, seed=5)

    def loss(backend, q_nope, o_latent, kv_b):
        return jnp.sum(jnp.sin(absorb_query(q_nope, kv_b, backend=backend))) + jnp.sum(
            jnp.cos(expand_output(o_latent, kv_b, 16, backend=backend))
        )

    grads = {
        b: jax.jit(jax.grad(functools.partial(loss, b), argnums=(0, 1, 2)))(q_nope, o_latent, kv_b) for b in BACKENDS
    }
    for a, b in zip(grads["interpret_gpu"], grads["reference"]):
        assert rel_error(a, b) <= 1e-6


def test_gpu_kernels_lower_for_cuda():
    """Ling-3.1-flash: 64 heads, nope 128, v 128, latent 512, bf16 kv_b_proj; one decode token."""
    kv_b = jax.ShapeDtypeStruct((64, 256, 512), jnp.bfloat16)
    text = lower_for_cuda(
        functools.partial(absorb_query, backend="pallas_gpu"), jax.ShapeDtypeStruct((1, 64, 128), jnp.bfloat16), kv_b
    ).as_text()
    assert "mla_absorb_query" in text
    text = lower_for_cuda(
        functools.partial(expand_output, nope=128, backend="pallas_gpu"),
        jax.ShapeDtypeStruct((1, 64, 512), jnp.float32),
        kv_b,
    ).as_text()
    assert "mla_expand_output" in text


@pytest.mark.gpu
@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="the compiled Triton kernels need a GPU; they run on the device machine (pytest -m gpu)",
)
@pytest.mark.parametrize("rows", [1, ROWS])
def test_compiled_gpu_kernels(rows):
    q_nope, o_latent, kv_b = random_case(rows, 64, 128, 128, 512, jnp.bfloat16, seed=rows)
    q_latent = absorb_query(q_nope, kv_b, backend="pallas_gpu")
    out = expand_output(o_latent.astype(jnp.float32), kv_b, 128, backend="pallas_gpu")
    assert rel_error(q_latent, np.einsum("mhn,hnr->mhr", f64(q_nope), f64(kv_b)[:, :128])) <= 1e-5
    assert rel_error(out, np.einsum("mhr,hvr->mhv", f64(o_latent), f64(kv_b)[:, 128:])) <= 1e-5
