"""Decode caches. The layout is documented here, once.

Per sequence b of a batch:
- `lengths[b]` (int32): how many real tokens the sequence holds. It is also the RoPE position of the next
  token and the slot it will be written to: real tokens are stored densely from slot 0, pads never are.
- KDA layer (`KDAState`): `conv_window` [B, K-1, 3C] in the activation dtype, the last K-1 *pre-conv*
  projections [q ; k ; v] of real tokens (oldest first); `recurrent_state` [B, H, d, d] fp32, S[key, value].
  Both are fixed-size: they do not grow with context (3.1-flash: 4 MiB of state per layer and sequence).
- MLA layer (`MLAState`): `latent` [B, max_length, kv_lora_rank + qk_rope_head_dim] in the activation
  dtype: per slot [c_kv after kv_a_layernorm (512) ; k_pe after RoPE (64)] = 576 values, the absorbed
  form's whole cache (an expanded cache would hold H * (192 + 128) values per token). RoPE pairs sit where
  the checkpoint's rope dims are (interleaved pairs in place), unlike transformers' de-interleaved copy.
- Paged MLA layer (`PagedMLAState`, the server's layout): `latent_pages` [P, page_size, A], a pool of pages
  shared by every sequence; `LingCache.page_table` [B, N] int32 maps sequence b's slot s to row
  s % page_size of page page_table[b, s // page_size] (one table for every paged layer, so a page id names the
  same tokens in each). Sequences that share a prefix may share its pages; an entry >= P is no page (writes
  there are dropped).
- MTP layer: an `MLAState` of its own plus its own lengths (`MTPCache`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ling_jax.config import KDA, LingConfig


@struct.dataclass
class KDAState:
    conv_window: jax.Array  # [B, K-1, 3C]
    recurrent_state: jax.Array  # [B, H, d, d] fp32

    @classmethod
    def zeros(cls, config: LingConfig, batch_size: int, dtype) -> KDAState:
        c = config
        return cls(
            conv_window=jnp.zeros((batch_size, c.short_conv_kernel_size - 1, 3 * c.kda_dim), dtype),
            recurrent_state=jnp.zeros((batch_size, c.num_attention_heads, c.head_dim, c.head_dim), jnp.float32),
        )


@struct.dataclass
class MLAState:
    latent: jax.Array  # [B, max_length, kv_lora_rank + qk_rope_head_dim]

    @classmethod
    def zeros(cls, config: LingConfig, batch_size: int, max_length: int, dtype) -> MLAState:
        return cls(latent=jnp.zeros((batch_size, max_length, config.latent_dim), dtype))


@struct.dataclass
class PagedMLAState:
    latent_pages: jax.Array  # [P, page_size, kv_lora_rank + qk_rope_head_dim]


@struct.dataclass
class LingCache:
    layers: tuple  # one KDAState, MLAState or PagedMLAState per decoder layer
    lengths: jax.Array  # [B] int32
    page_table: jax.Array | None = None  # [B, N] int32: the PagedMLAState layers' pages per sequence

    @property
    def max_length(self) -> int:
        for s in self.layers:
            if isinstance(s, MLAState):
                return s.latent.shape[1]
            if isinstance(s, PagedMLAState):
                return self.page_table.shape[1] * s.latent_pages.shape[1]
        return 0

    @classmethod
    def create(cls, config: LingConfig, batch_size: int, max_length: int, dtype) -> LingCache:
        layers = tuple(
            KDAState.zeros(config, batch_size, dtype)
            if kind == KDA
            else MLAState.zeros(config, batch_size, max_length, dtype)
            for kind in config.layer_types
        )
        return cls(layers=layers, lengths=jnp.zeros((batch_size,), jnp.int32))

    @classmethod
    def create_paged(
        cls, config: LingConfig, batch_size: int, num_pages: int, page_size: int, pages_per_sequence: int, dtype
    ) -> LingCache:
        """Paged caches: `num_pages` pages of `page_size` slots per MLA layer, every table entry empty (P)."""
        layers = tuple(
            KDAState.zeros(config, batch_size, dtype)
            if kind == KDA
            else PagedMLAState(latent_pages=jnp.zeros((num_pages, page_size, config.latent_dim), dtype))
            for kind in config.layer_types
        )
        return cls(
            layers=layers,
            lengths=jnp.zeros((batch_size,), jnp.int32),
            page_table=jnp.full((batch_size, pages_per_sequence), num_pages, jnp.int32),
        )


def commit_verified(cache: LingCache, accepted_B: jax.Array, num_verified: int, real_B=None) -> LingCache:
    """Keep the first accepted_B[b] + 1 of the `num_verified` tokens a steps-mode call appended.

    The call left one KDA state per verified token; the state after the last kept token is taken (no
    recomputation). MLA slots past the new lengths stay in the buffer, invisible, and are overwritten later.
    real_B: the rows whose tokens were real (None: all); the others' were pads (masked), which left every state
    and the length as they were, so they stay so.
    """
    rows = jnp.arange(accepted_B.shape[0])
    layers = tuple(
        KDAState(conv_window=s.conv_window[rows, accepted_B], recurrent_state=s.recurrent_state[rows, accepted_B])
        if isinstance(s, KDAState)
        else s
        for s in cache.layers
    )
    dropped_B = num_verified - accepted_B - 1
    if real_B is not None:
        dropped_B = jnp.where(real_B, dropped_B, 0)
    return cache.replace(layers=layers, lengths=cache.lengths - dropped_B)


@struct.dataclass
class MTPCache:
    layer: MLAState
    lengths: jax.Array  # [B] int32

    @classmethod
    def create(cls, config: LingConfig, batch_size: int, max_length: int, dtype) -> MTPCache:
        return cls(
            layer=MLAState.zeros(config, batch_size, max_length, dtype), lengths=jnp.zeros((batch_size,), jnp.int32)
        )
