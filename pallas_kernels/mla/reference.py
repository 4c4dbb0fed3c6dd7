"""Multi-head latent attention in pure jnp, the spec in code (spec §3.4), the reference of every MLA op.

Absorbed attention (decode): every head attends to the same cached key [c_kv ; k_pe] (latent_dim + rope_dim
values per token) with the query [q_nope W_UK ; q_pe]; the value is c_kv itself, so the output stays in latent
space and the caller maps it to per-head values with W_UV. The weight products around it (`absorb_query_reference`,
`expand_output_reference`) read W_UK and W_UV as slices of kv_b_proj's per-head rows [nope ; v], from the
[H, nope + v, R] view of that weight.

Expanded attention (prefill), flash style (`flash_expanded_attention`): queries in chunks (lax.map), keys in
blocks (lax.scan) with an online softmax, each key block expanded from the latent cache only when needed. Memory
is O(query_block x key_block) per head instead of O(T x S), so a 262,144-token prefill fits; key blocks that no
query of the chunk can see (beyond the causal frontier, or empty cache) are skipped. Visibility: query t sees key
slot s iff s <= query_slots[b, t] and key_valid[b, s].
"""

from __future__ import annotations

import functools

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
    scores_BTHS = (
        jnp.einsum("bthr,bsr->bths", q_latent_BTHR.astype(dtype), c_kv_BSR, preferred_element_type=jnp.float32)
        + jnp.einsum("bthp,bsp->bths", q_rope_BTHP.astype(dtype), k_pe_BSP, preferred_element_type=jnp.float32)
    ) * scale
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


def mla_decode_tokens_reference(q_latent_BTHR, q_rope_BTHP, kv_cache_BLA, lengths_BT, *, scale: float) -> jax.Array:
    """T query tokens per sequence, token t over the first lengths[b, t] cache slots; o_latent [B, T, H, R] fp32."""
    slots = jnp.arange(kv_cache_BLA.shape[1])
    visible_BTL = slots[None, None, :] < lengths_BT[:, :, None]
    return absorbed_attention(q_latent_BTHR, q_rope_BTHP, kv_cache_BLA, visible_BTL, scale=scale)


def gather_pages(kv_pages_PSA: jax.Array, page_table_BN: jax.Array) -> jax.Array:
    """A paged latent cache as a contiguous one: [B, max_pages * page_size, A], sequence b's pages in table
    order (entries outside [0, P), e.g. unused ones, are clipped to a valid page: callers mask them by length)."""
    batch, max_pages = page_table_BN.shape
    pages_BNSA = jnp.take(kv_pages_PSA, jnp.clip(page_table_BN, 0, kv_pages_PSA.shape[0] - 1), axis=0)
    return pages_BNSA.reshape(batch, max_pages * kv_pages_PSA.shape[1], kv_pages_PSA.shape[2])


def mla_decode_paged_reference(
    q_latent_BHR, q_rope_BHP, kv_pages_PSA, page_table_BN, lengths_B, *, scale: float
) -> jax.Array:
    """`mla_decode_reference` over a paged cache: slot s of sequence b is row s % page_size of page
    page_table[b, s // page_size]."""
    return mla_decode_reference(
        q_latent_BHR, q_rope_BHP, gather_pages(kv_pages_PSA, page_table_BN), lengths_B, scale=scale
    )


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


def absorb_query_reference(q_nope_MHN, kv_b_HCR) -> jax.Array:
    """q_latent [M, H, R] fp32 = q_nope @ W_UK per head (W_UK = the first N rows of each head)."""
    w_uk_HNR = kv_b_HCR[:, : q_nope_MHN.shape[-1]]
    return jnp.einsum("mhn,hnr->mhr", q_nope_MHN.astype(jnp.float32), w_uk_HNR.astype(jnp.float32))


def expand_output_reference(o_latent_MHR, kv_b_HCR, nope: int) -> jax.Array:
    """[M, H, V] fp32 = o_latent @ W_UV^T per head (W_UV = the rows after the first `nope` of each head)."""
    w_uv_HVR = kv_b_HCR[:, nope:]
    return jnp.einsum("mhr,hvr->mhv", o_latent_MHR.astype(jnp.float32), w_uv_HVR.astype(jnp.float32))


def _pad_to(x, axis, multiple, value):
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


@functools.partial(jax.jit, static_argnames=("scale", "query_block", "key_block"))
def flash_expanded_attention(
    q_nope_BTHN,
    q_pe_BTHP,
    latent_BSA,
    query_slots_BT,
    key_valid_BS,
    w_uk_HNR,
    w_uv_HVR,
    *,
    scale: float,
    query_block: int = 2048,
    key_block: int = 512,
):
    """Expanded MLA attention -> o [B, T, H, V] in q's dtype.

    q_nope [B, T, H, N], q_pe [B, T, H, P] (roped); latent [B, S, R + P] = [c_kv ; k_pe] per key slot;
    W_UK [H, N, R], W_UV [H, V, R] (kv_b_proj split per head). Scores and the softmax are fp32.
    """
    batch, length, heads, _ = q_nope_BTHN.shape
    latent_dim = w_uk_HNR.shape[-1]
    dtype = q_nope_BTHN.dtype
    query_block = min(query_block, length)
    key_block = min(key_block, latent_BSA.shape[1])
    q_nope = _pad_to(q_nope_BTHN, 1, query_block, 0)
    q_pe = _pad_to(q_pe_BTHP, 1, query_block, 0)
    query_slots = _pad_to(query_slots_BT, 1, query_block, -1)
    latent = _pad_to(latent_BSA.astype(dtype), 1, key_block, 0)
    key_valid = _pad_to(key_valid_BS, 1, key_block, False)
    num_q, num_k = q_nope.shape[1] // query_block, latent.shape[1] // key_block
    w_uk, w_uv = w_uk_HNR.astype(dtype), w_uv_HVR.astype(dtype)

    def chunks(x, size):  # [B, n * size, ...] -> [n, B, size, ...]
        return jnp.moveaxis(x.reshape(batch, -1, size, *x.shape[2:]), 1, 0)

    latent_blocks, valid_blocks = chunks(latent, key_block), chunks(key_valid, key_block)

    def query_chunk(xs):
        qn_BQHN, qp_BQHP, slots_BQ = xs
        frontier = jnp.max(slots_BQ)  # no key beyond the last query slot of the chunk is visible

        def key_step(carry, ys):
            index, block_BKA, valid_BK = ys
            first = index * key_block

            def attend(carry):
                acc_BQHV, m_BHQ, l_BHQ = carry
                c_kv, k_pe = block_BKA[..., :latent_dim], block_BKA[..., latent_dim:]
                k_nope = jnp.einsum("bkr,hnr->bkhn", c_kv, w_uk)
                v = jnp.einsum("bkr,hvr->bkhv", c_kv, w_uv)
                scores = (
                    jnp.einsum("bqhn,bkhn->bhqk", qn_BQHN, k_nope, preferred_element_type=jnp.float32)
                    + jnp.einsum("bqhp,bkp->bhqk", qp_BQHP, k_pe, preferred_element_type=jnp.float32)
                ) * scale
                key_slots = first + jnp.arange(key_block)
                visible = (key_slots[None, None, :] <= slots_BQ[:, :, None]) & valid_BK[:, None, :]  # [B, Q, K]
                scores = jnp.where(visible[:, None], scores, -jnp.inf)
                m_new = jnp.maximum(m_BHQ, jnp.max(scores, axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(scores - m_safe[..., None])
                correction = jnp.exp(jnp.where(jnp.isfinite(m_BHQ), m_BHQ, m_safe) - m_safe)
                acc_BQHV = acc_BQHV * jnp.moveaxis(correction, 1, 2)[..., None] + jnp.einsum(
                    "bhqk,bkhv->bqhv", p.astype(dtype), v, preferred_element_type=jnp.float32
                )
                return acc_BQHV, m_new, l_BHQ * correction + jnp.sum(p, axis=-1)

            needed = (first <= frontier) & jnp.any(valid_BK)
            return jax.lax.cond(needed, attend, lambda c: c, carry), None

        init = (
            jnp.zeros((batch, query_block, heads, w_uv.shape[1]), jnp.float32),
            jnp.full((batch, heads, query_block), -jnp.inf, jnp.float32),
            jnp.zeros((batch, heads, query_block), jnp.float32),
        )
        (acc, _, weight_sum), _ = jax.lax.scan(key_step, init, (jnp.arange(num_k), latent_blocks, valid_blocks))
        weight_sum_BQH = jnp.moveaxis(weight_sum, 1, 2)
        return (acc / jnp.where(weight_sum_BQH > 0, weight_sum_BQH, 1.0)[..., None]).astype(dtype)

    o = jax.lax.map(
        query_chunk, (chunks(q_nope, query_block), chunks(q_pe, query_block), chunks(query_slots, query_block))
    )
    return jnp.moveaxis(o, 0, 1).reshape(batch, num_q * query_block, heads, -1)[:, :length]
