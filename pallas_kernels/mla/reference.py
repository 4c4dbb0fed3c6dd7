"""Absorbed multi-head latent attention in pure jnp (spec §3.4).

Every head attends to the same cached key [c_kv ; k_pe] (latent_dim + rope_dim values per token) with the
query [q_nope W_UK ; q_pe]; the value is c_kv itself, so the output stays in latent space and the caller
maps it to per-head values with W_UV.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def absorbed_attention(q_latent_BTHR, q_rope_BTHP, kv_cache_BSA, visible_BTS, *, scale: float) -> jax.Array:
    """Softmax over cached slots; returns the latent output [B, T, H, R] in fp32.

    kv_cache_BSA holds [c_kv (R) ; k_pe (P)] per slot; visible_BTS says which slots each query may see.
    Products run in the cache dtype with fp32 accumulation (queries and probabilities are rounded to it).
    """
    latent_dim = q_latent_BTHR.shape[-1]
    dtype = kv_cache_BSA.dtype
    c_kv_BSR, k_pe_BSP = kv_cache_BSA[..., :latent_dim], kv_cache_BSA[..., latent_dim:]
    scores_BTHS = (jnp.einsum("bthr,bsr->bths", q_latent_BTHR.astype(dtype), c_kv_BSR,
                              preferred_element_type=jnp.float32)
                   + jnp.einsum("bthp,bsp->bths", q_rope_BTHP.astype(dtype), k_pe_BSP,
                                preferred_element_type=jnp.float32)) * scale
    visible_BT1S = visible_BTS[:, :, None, :]
    scores_BTHS = jnp.where(visible_BT1S, scores_BTHS, -jnp.inf)
    peak = jnp.max(scores_BTHS, axis=-1, keepdims=True)
    weights = jnp.where(visible_BT1S, jnp.exp(scores_BTHS - jnp.where(jnp.isfinite(peak), peak, 0.0)), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs_BTHS = weights / jnp.where(total > 0, total, 1.0)  # a query that sees no key gets zeros
    return jnp.einsum("bths,bsr->bthr", probs_BTHS.astype(dtype), c_kv_BSR, preferred_element_type=jnp.float32)


def mla_decode_reference(q_latent_BHR, q_rope_BHP, kv_cache_BLA, lengths_B, *, scale: float) -> jax.Array:
    """One query token per sequence over the first lengths[b] cache slots; returns o_latent [B, H, R] fp32."""
    slots = jnp.arange(kv_cache_BLA.shape[1])
    visible_B1L = (slots[None, :] < lengths_B[:, None])[:, None, :]
    o = absorbed_attention(q_latent_BHR[:, None], q_rope_BHP[:, None], kv_cache_BLA, visible_B1L, scale=scale)
    return o[:, 0]


def gather_pages(kv_pages_PSA: jax.Array, page_table_BN: jax.Array) -> jax.Array:
    """A paged latent cache as a contiguous one: [B, max_pages * page_size, A], sequence b's pages in table
    order (entries outside [0, P), e.g. unused ones, are clipped to a valid page: callers mask them by length)."""
    batch, max_pages = page_table_BN.shape
    pages_BNSA = jnp.take(kv_pages_PSA, jnp.clip(page_table_BN, 0, kv_pages_PSA.shape[0] - 1), axis=0)
    return pages_BNSA.reshape(batch, max_pages * kv_pages_PSA.shape[1], kv_pages_PSA.shape[2])


def mla_decode_paged_reference(q_latent_BHR, q_rope_BHP, kv_pages_PSA, page_table_BN, lengths_B, *,
                               scale: float) -> jax.Array:
    """`mla_decode_reference` over a paged cache: slot s of sequence b is row s % page_size of page
    page_table[b, s // page_size]."""
    return mla_decode_reference(q_latent_BHR, q_rope_BHP, gather_pages(kv_pages_PSA, page_table_BN), lengths_B,
                                scale=scale)


def combine_splits(o_BSHR: jax.Array, lse_BSH: jax.Array) -> jax.Array:
    """Exact merge of per-split softmax results (flash-decoding): o = sum_s softmax_s(lse) * o_s.

    A split that saw no key has lse = -inf and weight 0; a sequence with no key at all gets zeros.
    """
    lse_max = jnp.max(lse_BSH, axis=1, keepdims=True)
    lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
    weights_BSH = jnp.exp(lse_BSH - lse_max)
    total_B1H = jnp.sum(weights_BSH, axis=1, keepdims=True)
    weights_BSH = weights_BSH / jnp.where(total_B1H > 0, total_B1H, 1.0)
    return jnp.einsum("bsh,bshr->bhr", weights_BSH, o_BSHR)
