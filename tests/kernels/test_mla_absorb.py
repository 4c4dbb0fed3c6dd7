"""The absorbed-MLA weight products (`pallas_kernels.mla.absorb_query`, `expand_output`): the GPU kernels for a
few query rows (Pallas interpret mode on the CPU, compiled on the device machine) and the jnp reference against
float64 numpy, for a dense and a block-FP8 kv_b_proj (read as stored); gradients; lowering for CUDA at
Ling-3.1-flash size."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import lower_for_cuda, rel_error

from ling_jax.quantized import BlockFP8Weight
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


def random_fp8_weight(heads, head_rows, rank, block, seed) -> BlockFP8Weight:
    """A per-head block-FP8 kv_b [H, nope + v, R] (scales [H, head_rows / br, ceil(R / bc)]) of about unit-size
    elements."""
    r = np.random.default_rng(seed)
    values = np.asarray(r.normal(size=(heads, head_rows, rank)) * 60.0, ml_dtypes.float8_e4m3fn)
    scales = r.uniform(0.5, 1.5, (heads, head_rows // block[0], -(-rank // block[1]))) / 60.0
    return BlockFP8Weight(jnp.asarray(values), jnp.asarray(scales, jnp.float32), block)


@pytest.mark.parametrize("rows", [1, 5])
def test_block_fp8_kv_b_is_dequantised_tile_by_tile(rows):
    """Scale blocks smaller than the tiles (16 x 32: several a tile, a row block straddling W_UK / W_UV) and a
    partial last column block: the kernels equal the reference on the weight dequantised to bf16, and never
    convert the whole weight."""
    heads, nope, value, rank = 3, 32, 16, 80
    kv_b = random_fp8_weight(heads, nope + value, rank, (16, 32), seed=rows)
    r = np.random.default_rng(rows)
    q_nope = jnp.asarray(r.normal(size=(rows, heads, nope)), jnp.bfloat16)
    o_latent = jnp.asarray(r.normal(size=(rows, heads, rank)), jnp.float32)
    dense = f64(kv_b.dequantize(jnp.bfloat16))
    products = {
        "absorb": (functools.partial(absorb_query, q_nope), np.einsum("mhn,hnr->mhr", f64(q_nope), dense[:, :nope])),
        "expand": (
            functools.partial(expand_output, o_latent, nope=nope),
            np.einsum("mhr,hvr->mhv", f64(o_latent), dense[:, nope:]),
        ),
    }
    for product, expected in products.values():
        for backend in BACKENDS:
            assert rel_error(product(kv_b, dtype=jnp.bfloat16, backend=backend), expected) <= 1e-6
        text = str(jax.make_jaxpr(functools.partial(product, dtype=jnp.bfloat16, backend="interpret_gpu"))(kv_b))
        assert f"[{heads},{nope + value},{rank}]" not in text.replace("f8_e4m3fn[", "")


def test_quantised_kv_b_needs_the_model_dtype():
    kv_b = random_fp8_weight(2, 32, 64, (16, 32), seed=0)
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="quantised kv_b_proj needs dtype"):
            absorb_query(jnp.zeros((1, 2, 16), jnp.bfloat16), kv_b, backend=backend)


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


def test_gpu_kernels_lower_for_cuda_from_block_fp8():
    """Ling-3.0-flash's kv_b_proj as stored: e4m3 [32 heads x 256, 512] in 128 x 128 blocks, split per head."""
    kv_b = BlockFP8Weight(
        jax.ShapeDtypeStruct((32, 256, 512), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((32, 2, 4), jnp.float32),
        (128, 128),
    )
    for product, vectors in (
        (functools.partial(absorb_query, dtype=jnp.bfloat16, backend="pallas_gpu"), (1, 32, 128, jnp.bfloat16)),
        (
            functools.partial(expand_output, nope=128, dtype=jnp.bfloat16, backend="pallas_gpu"),
            (8, 32, 512, jnp.float32),
        ),
    ):
        text = lower_for_cuda(product, jax.ShapeDtypeStruct(vectors[:3], vectors[3]), kv_b).as_text()
        assert "tensor<32x256x512xf8E4M3FN>" in text and "32x256x512xbf16" not in text


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
