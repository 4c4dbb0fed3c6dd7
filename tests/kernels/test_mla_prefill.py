"""Flash-style expanded MLA prefill (query chunks x key blocks, skipped blocks) vs a float64 dense softmax."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla.prefill import flash_expanded_attention

HEADS, NOPE, ROPE, VALUE, LATENT = 3, 12, 8, 10, 24


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


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("blocks", [(16, 32), (64, 7), (2048, 512)])
def test_flash_prefill_matches_dense_float64(dtype, tol, blocks):
    r = np.random.default_rng(blocks[0] + blocks[1])
    batch, length, slots = 2, 45, 100
    q_nope = r.normal(size=(batch, length, HEADS, NOPE))
    q_pe = r.normal(size=(batch, length, HEADS, ROPE))
    latent = r.normal(size=(batch, slots, LATENT + ROPE))
    w_uk = r.normal(size=(HEADS, NOPE, LATENT)) / np.sqrt(LATENT)
    w_uv = r.normal(size=(HEADS, VALUE, LATENT)) / np.sqrt(LATENT)
    # row 0: a chunk appended after 30 cached tokens (causal with an offset); row 1: ragged, one pad query
    query_slots = np.stack([30 + np.arange(length), np.r_[-1, np.arange(length - 1) * 2]])
    key_valid = np.stack([np.arange(slots) < 30 + length, r.uniform(size=slots) < 0.7])
    rounded = [np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)
               for x in (q_nope, q_pe, latent, w_uk, w_uv)]
    ref = float64_expanded(rounded[0], rounded[1], rounded[2], query_slots, key_valid, rounded[3], rounded[4], 0.2)
    out = flash_expanded_attention(*(jnp.asarray(x, dtype) for x in rounded[:3]), jnp.asarray(query_slots, jnp.int32),
                                   jnp.asarray(key_valid), *(jnp.asarray(x, dtype) for x in rounded[3:]),
                                   scale=0.2, query_block=blocks[0], key_block=blocks[1])
    assert out.shape == ref.shape and out.dtype == dtype
    err = float(np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref))
    assert err <= tol, f"blocks {blocks}: rel. error {err:.2e}"
    np.testing.assert_array_equal(np.asarray(out[1, 0], np.float64), 0.0)  # the pad query sees nothing
