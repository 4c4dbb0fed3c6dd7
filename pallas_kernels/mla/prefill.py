"""MLA prefill over the expanded heads, flash style, in jnp: queries in chunks (lax.map), keys in blocks
(lax.scan) with an online softmax, each key block expanded from the latent cache only when needed.

Memory is O(query_block x key_block) per head instead of O(T x S), so a 262,144-token prefill fits; key
blocks that no query of the chunk can see (beyond the causal frontier, or empty cache) are skipped.
Visibility: query t sees key slot s iff s <= query_slots[b, t] and key_valid[b, s].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _pad_to(x, axis, multiple, value):
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


@functools.partial(jax.jit, static_argnames=("scale", "query_block", "key_block"))
def flash_expanded_attention(q_nope_BTHN, q_pe_BTHP, latent_BSA, query_slots_BT, key_valid_BS, w_uk_HNR, w_uv_HVR,
                             *, scale: float, query_block: int = 2048, key_block: int = 512):
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
                scores = (jnp.einsum("bqhn,bkhn->bhqk", qn_BQHN, k_nope, preferred_element_type=jnp.float32)
                          + jnp.einsum("bqhp,bkp->bhqk", qp_BQHP, k_pe, preferred_element_type=jnp.float32)) * scale
                key_slots = first + jnp.arange(key_block)
                visible = (key_slots[None, None, :] <= slots_BQ[:, :, None]) & valid_BK[:, None, :]  # [B, Q, K]
                scores = jnp.where(visible[:, None], scores, -jnp.inf)
                m_new = jnp.maximum(m_BHQ, jnp.max(scores, axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(scores - m_safe[..., None])
                correction = jnp.exp(jnp.where(jnp.isfinite(m_BHQ), m_BHQ, m_safe) - m_safe)
                acc_BQHV = (acc_BQHV * jnp.moveaxis(correction, 1, 2)[..., None]
                            + jnp.einsum("bhqk,bkhv->bqhv", p.astype(dtype), v, preferred_element_type=jnp.float32))
                return acc_BQHV, m_new, l_BHQ * correction + jnp.sum(p, axis=-1)

            needed = (first <= frontier) & jnp.any(valid_BK)
            return jax.lax.cond(needed, attend, lambda c: c, carry), None

        init = (jnp.zeros((batch, query_block, heads, w_uv.shape[1]), jnp.float32),
                jnp.full((batch, heads, query_block), -jnp.inf, jnp.float32),
                jnp.zeros((batch, heads, query_block), jnp.float32))
        (acc, _, weight_sum), _ = jax.lax.scan(key_step, init, (jnp.arange(num_k), latent_blocks, valid_blocks))
        weight_sum_BQH = jnp.moveaxis(weight_sum, 1, 2)
        return (acc / jnp.where(weight_sum_BQH > 0, weight_sum_BQH, 1.0)[..., None]).astype(dtype)

    o = jax.lax.map(query_chunk, (chunks(q_nope, query_block), chunks(q_pe, query_block),
                                  chunks(query_slots, query_block)))
    return jnp.moveaxis(o, 0, 1).reshape(batch, num_q * query_block, heads, -1)[:, :length]
