"""What every layer of one call shares besides the hidden states: masks, cache slots, RoPE tables, the policy.

`token_context` builds it once per forward call; the layer functions (`ling_jax.functional`) take it as `ctx`.
`TokenContext` is a pytree (its arrays are leaves, the policy is static), so it can be an argument of a jitted
function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ling_jax.config import LingConfig
from ling_jax.policy import ExecutionPolicy, KDAMode, MLAMode, as_policy
from ling_jax.rope import rope_cos_sin


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


@struct.dataclass
class TokenContext:
    """Everything a layer needs to know about the T tokens of one call besides their hidden states."""

    mask_BT: jax.Array | None  # real (True) vs pad tokens; None = all real
    cos: jax.Array  # [B, T, rope_dim / 2]
    sin: jax.Array
    slots_BT: jax.Array | None  # cache slot per token (pads: out of range, dropped); None without a cache
    visibility: KeyVisibility  # which keys (cache slots, or the T tokens themselves) each query may see
    decode_lengths_B: jax.Array | None  # one-token decode over a cache: the visible prefix per sequence
    policy: ExecutionPolicy = struct.field(pytree_node=False)  # both modes concrete (`ExecutionPolicy.for_call`)
    page_table_BN: jax.Array | None = None  # a paged cache's pages per sequence (`ling_jax.cache`); None: not paged

    @property
    def kda_mode(self) -> KDAMode:
        return self.policy.kda_mode

    @property
    def mla_mode(self) -> MLAMode:
        return self.policy.mla_mode


def token_context(
    config: LingConfig,
    batch: int,
    length: int,
    *,
    positions=None,
    attention_mask=None,
    lengths=None,
    max_length: int = 0,
    page_table=None,
    policy: ExecutionPolicy | None = None,
    kda_mode: KDAMode | None = None,
    mla_mode: MLAMode | None = None,
) -> TokenContext:
    """Masks, slots and RoPE tables for a call of T = `length` tokens per row.

    lengths: the cache's [B] token count (the new tokens go to slots lengths[b], ...), or None without a cache;
    max_length: the cache's slots; page_table: a paged cache's [B, N] table (`LingCache.page_table`).
    positions default to each real token's index (after the cached ones).
    policy: the execution policy (default: `ExecutionPolicy()`); kda_mode / mla_mode override its modes for this
    call.
    """
    policy = as_policy(policy).for_call(length, cached=lengths is not None, kda_mode=kda_mode, mla_mode=mla_mode)
    mask = None if attention_mask is None else jnp.asarray(attention_mask).astype(bool)
    real = jnp.ones((batch, length), bool) if mask is None else mask
    offsets_BT = jnp.cumsum(real, axis=1, dtype=jnp.int32) - 1  # index of each real token among the new ones
    decode_lengths = None
    if lengths is None:  # keys are the T tokens themselves; pad queries still see earlier real tokens
        visibility = KeyVisibility(jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length)), real)
        default_positions, slots = jnp.maximum(offsets_BT, 0), None
    else:
        slots_real = lengths[:, None] + offsets_BT
        slots = jnp.where(real, slots_real, max_length)
        new_lengths = lengths + real.sum(axis=1, dtype=jnp.int32)
        visibility = KeyVisibility(
            jnp.where(real, slots_real, -1), jnp.arange(max_length)[None, :] < new_lengths[:, None]
        )
        default_positions = jnp.maximum(slots_real, 0)
        if length == 1:
            decode_lengths = new_lengths
    if positions is None:
        positions = default_positions
    positions = jnp.asarray(positions)
    shape = (batch, length, 3) if positions.ndim == 3 else (batch, length)  # [B, T, 3]: VL (t, h, w) positions
    cos, sin = rope_cos_sin(jnp.broadcast_to(positions, shape), config)
    return TokenContext(mask, cos, sin, slots, visibility, decode_lengths, policy, page_table)
