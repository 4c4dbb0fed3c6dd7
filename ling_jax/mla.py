"""Gated multi-head latent attention (spec §3): expanded form for prefill, absorbed latent form for decode.

Both forms read and write the same latent cache, [c_kv (kv_lora_rank) ; k_pe (qk_rope_head_dim)] per token
(576 values for Ling; layout in `ling_jax.cache`). They differ only in where W_UK / W_UV are applied.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from ling_jax.config import LingConfig
from ling_jax.layers import Linear, RMSNorm
from ling_jax.rope import apply_rope, softmax_scale
from pallas_kernels.mla.ops import absorb_query, expand_output, mla_decode, mla_prefill
from pallas_kernels.mla.reference import absorbed_attention

EXPANDED = "expanded"
ABSORBED = "absorbed"


@struct.dataclass
class KeyVisibility:
    """Which key slots each query may see, without an O(T x S) mask: query t sees slot s iff
    s <= query_slots[b, t] and key_valid[b, s] (a pad query has slot -1 and sees nothing)."""

    query_slots_BT: jax.Array  # int32
    key_valid_BS: jax.Array  # bool

    def dense(self) -> jax.Array:
        """The [B, T, S] mask, for small problems and tests."""
        slots = jnp.arange(self.key_valid_BS.shape[1])
        return (slots[None, None, :] <= self.query_slots_BT[:, :, None]) & self.key_valid_BS[:, None, :]


class MultiLatentAttention(nnx.Module):
    def __init__(self, config: LingConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        heads, hidden = c.num_attention_heads, c.hidden_size
        if c.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads * c.qk_head_dim, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        else:
            self.q_a_proj = Linear(hidden, c.q_lora_rank, axes=("q_lora", "embed"), dtype=dtype, rngs=rngs)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dtype=dtype)
            self.q_b_proj = Linear(c.q_lora_rank, heads * c.qk_head_dim, axes=("heads", "q_lora"),
                                   dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(hidden, c.latent_dim, axes=("kv_latent", "embed"), dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps, dtype=dtype)
        self.kv_b_proj = Linear(c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim),
                                axes=("heads", "kv_latent"), dtype=dtype, rngs=rngs)
        self.g_proj = Linear(hidden, heads, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        self.dense = Linear(heads * c.v_head_dim, hidden, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        self.scale = softmax_scale(c)

    def _queries(self, x_BTD, cos, sin):
        c = self.config
        if c.q_lora_rank is None:
            q = self.q_proj(x_BTD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        q_BTHQ = q.reshape(*x_BTD.shape[:2], c.num_attention_heads, c.qk_head_dim)
        q_nope, q_pe = q_BTHQ[..., :c.qk_nope_head_dim], q_BTHQ[..., c.qk_nope_head_dim:]
        return q_nope, apply_rope(q_pe, cos, sin, interleave=c.rope.interleave)

    def latent(self, x_BTD, cos, sin) -> jax.Array:
        """The per-token cache entry [c_kv after kv_a_layernorm ; k_pe after RoPE], [B, T, latent_dim]."""
        c = self.config
        kv = self.kv_a_proj_with_mqa(x_BTD)
        c_kv = self.kv_a_layernorm(kv[..., :c.kv_lora_rank])
        k_pe = apply_rope(kv[..., c.kv_lora_rank:], cos, sin, interleave=c.rope.interleave)
        return jnp.concatenate([c_kv, k_pe.astype(c_kv.dtype)], axis=-1)

    def _kv_b_per_head(self):
        """kv_b_proj's weight as [H, nope + v, R]: each head's [W_UK ; W_UV] rows."""
        c = self.config
        return self.kv_b_proj.weight[...].reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim,
                                                  c.kv_lora_rank)

    def _kv_b_heads(self):
        """W_UK [H, nope, R] and W_UV [H, v, R] from kv_b_proj's per-head [nope ; v] rows."""
        w = self._kv_b_per_head()
        return w[:, :self.config.qk_nope_head_dim], w[:, self.config.qk_nope_head_dim:]

    def __call__(self, x_BTD, cos, sin, *, keys_BSA, visibility: KeyVisibility, mode: str = EXPANDED,
                 decode_lengths_B=None, kernel_backend: str = "reference") -> jax.Array:
        """Attend from the T tokens of x to the S latent entries keys_BSA (the cache, or the tokens themselves).

        cos, sin: [B, T, rope_dim/2] for the queries. Expanded mode is the flash-style prefill path
        (`pallas_kernels.mla.mla_prefill` with `kernel_backend`: memory O(block^2), not O(T x S)).
        decode_lengths_B: for a one-token decode over a cache whose first lengths[b] slots are visible,
        absorbed mode runs `pallas_kernels.mla.mla_decode` with `kernel_backend`.
        """
        q_nope, q_pe = self._queries(x_BTD, cos, sin)
        if mode == ABSORBED:
            batch, length = x_BTD.shape[:2]
            kv_b_HCR = self._kv_b_per_head()
            q_latent = absorb_query(q_nope.reshape(batch * length, *q_nope.shape[2:]), kv_b_HCR,
                                    backend=kernel_backend).reshape(*q_nope.shape[:3], -1)
            if decode_lengths_B is None:
                o_latent = absorbed_attention(q_latent, q_pe, keys_BSA, visibility.dense(), scale=self.scale)
            else:
                o_latent = mla_decode(q_latent[:, 0], q_pe[:, 0], keys_BSA, decode_lengths_B, scale=self.scale,
                                      backend=kernel_backend)[:, None]
            o_BTHV = expand_output(o_latent.reshape(batch * length, *o_latent.shape[2:]), kv_b_HCR,
                                   self.config.qk_nope_head_dim, backend=kernel_backend)
            o_BTHV = o_BTHV.reshape(batch, length, *o_BTHV.shape[1:]).astype(x_BTD.dtype)
        elif mode == EXPANDED:
            w_uk, w_uv = self._kv_b_heads()
            o_BTHV = mla_prefill(q_nope, q_pe, keys_BSA, visibility.query_slots_BT, visibility.key_valid_BS, w_uk,
                                 w_uv, scale=self.scale, backend=kernel_backend)
        else:
            raise ValueError(f"MLA mode must be {EXPANDED!r} or {ABSORBED!r}, got {mode!r}")
        gate_BTH = jax.nn.sigmoid(self.g_proj(x_BTD).astype(jnp.float32)).astype(x_BTD.dtype)
        o_BTHV = o_BTHV * gate_BTH[..., None]
        return self.dense(o_BTHV.reshape(*x_BTD.shape[:2], -1))
