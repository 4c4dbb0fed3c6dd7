"""Absorbed multi-head latent attention in pure jnp (spec §3.4).

Every head attends to the same cached key [c_kv ; k_pe] (latent_dim + rope_dim values per token) with the
query [q_nope W_UK ; q_pe]; the value is c_kv itself, so the output stays in latent space and the caller
maps it to per-head values with W_UV.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED_SCORE = -1e30  # finite: a query that sees nothing (a pad token) gets a uniform, not a NaN, row


def absorbed_attention(q_latent_BTHR, q_rope_BTHP, kv_cache_BSA, visible_BTS, *, scale: float) -> jax.Array:
    """Softmax over cached slots; returns the latent output [B, T, H, R] in fp32.

    kv_cache_BSA holds [c_kv (R) ; k_pe (P)] per slot; visible_BTS says which slots each query may see.
    """
    latent_dim = q_latent_BTHR.shape[-1]
    kv = kv_cache_BSA.astype(jnp.float32)
    c_kv_BSR, k_pe_BSP = kv[..., :latent_dim], kv[..., latent_dim:]
    scores_BTHS = (jnp.einsum("bthr,bsr->bths", q_latent_BTHR.astype(jnp.float32), c_kv_BSR)
                   + jnp.einsum("bthp,bsp->bths", q_rope_BTHP.astype(jnp.float32), k_pe_BSP)) * scale
    scores_BTHS = jnp.where(visible_BTS[:, :, None, :], scores_BTHS, MASKED_SCORE)
    probs_BTHS = jax.nn.softmax(scores_BTHS, axis=-1)
    return jnp.einsum("bths,bsr->bthr", probs_BTHS, c_kv_BSR)
