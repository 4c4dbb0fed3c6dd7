"""The absorbed-MLA weight products in pure jnp (spec §3.4): a query's no-RoPE part through W_UK into the
latent space, and the latent attention output through W_UV into the value heads. Both weights are slices of
kv_b_proj's per-head rows [nope ; v], read here from the [H, nope + v, R] view of that weight."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def absorb_query_reference(q_nope_MHN, kv_b_HCR) -> jax.Array:
    """q_latent [M, H, R] fp32 = q_nope @ W_UK per head (W_UK = the first N rows of each head)."""
    w_uk_HNR = kv_b_HCR[:, :q_nope_MHN.shape[-1]]
    return jnp.einsum("mhn,hnr->mhr", q_nope_MHN.astype(jnp.float32), w_uk_HNR.astype(jnp.float32))


def expand_output_reference(o_latent_MHR, kv_b_HCR, nope: int) -> jax.Array:
    """[M, H, V] fp32 = o_latent @ W_UV^T per head (W_UV = the rows after the first `nope` of each head)."""
    w_uv_HVR = kv_b_HCR[:, nope:]
    return jnp.einsum("mhr,hvr->mhv", o_latent_MHR.astype(jnp.float32), w_uv_HVR.astype(jnp.float32))
