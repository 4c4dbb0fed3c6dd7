"""Decode-cache memory budget: the logical bytes of the caches `cache.py` allocates (spec §2, §3.4).

Per sequence and decoder layer:
- KDA: a recurrent state H x d x d in fp32, whatever the activation dtype (3.1-flash: 64 * 128 * 128 * 4 B =
  4 MiB, 252 MiB over its 63 KDA layers), plus a conv window of the last K-1 pre-conv [q ; k ; v]
  projections (K-1 x 3C values). Neither grows with the context.
- MLA: the absorbed latent cache, kv_lora_rank + qk_rope_head_dim = 576 values per token (bf16: 1152 B).
  An expanded cache would hold per-head keys and values instead, H * (dn + dr + dv) values per token
  (3.1-flash: 64 * 320 = 20480, 35.56x the latent; 32-head 3.0-flash: 10240, 17.78x). It is reported for
  comparison only; nothing allocates it.
- Each cache also holds `lengths` [B] int32.

`CacheBudget.total_bytes` is exactly what `LingForCausalLM.init_cache` allocates (`cache_bytes` of a
`LingCache`). The MTP layer's cache is a separate `MTPCache` (`init_mtp_cache`) that only speculative
decoding allocates, so it is *not* in `total_bytes`: see `mtp_cache_bytes` and `total_with_mtp_bytes`.
Bytes are logical (shape x itemsize): allocator padding and the activations of a forward are not counted.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import jax
import jax.numpy as jnp

from ling_jax.config import KDA, MLA, LingConfig

_STATE_ITEMSIZE = 4  # KDA recurrent state is fp32 (cache.KDAState)
_LENGTHS_ITEMSIZE = 4  # lengths are int32


@dataclasses.dataclass(frozen=True)
class CacheBudget:
    """Decode-cache bytes for `batch_size` sequences of up to `context` tokens. Every byte field is linear in
    the batch size, so a field // batch_size is its per-sequence figure (as `table` prints)."""

    batch_size: int
    context: int
    dtype: str  # activation / cache dtype name (conv windows and latent caches; the KDA state is always fp32)
    kda_layers: int
    mla_layers: int
    mtp_layers: int  # 1 if the config has an MTP layer (this port builds one, as SGLang requires), else 0
    num_heads: int
    latent_values_per_token: int  # per MLA layer: kv_lora_rank + qk_rope_head_dim
    expanded_values_per_token: int  # per MLA layer: H * (qk_nope + qk_rope + v_head_dim)
    kda_state_bytes: int  # kda_layers * B * H * d * d * 4
    kda_conv_bytes: int  # kda_layers * B * (K-1) * 3C * itemsize
    absorbed_mla_bytes: int  # mla_layers * B * context * latent_dim * itemsize
    expanded_mla_bytes: int  # mla_layers * B * context * H * (dn + dr + dv) * itemsize; not allocated
    lengths_bytes: int  # B * 4: the int32 lengths of one cache (LingCache and MTPCache each hold one)
    mtp_bytes: int  # mtp_layers * B * context * latent_dim * itemsize: the MTP layer's latent cache

    @property
    def total_bytes(self) -> int:
        """Exactly the bytes of `LingCache.create(...)`: KDA states + conv windows + latent caches + lengths.
        Excludes the MTP cache."""
        return self.kda_state_bytes + self.kda_conv_bytes + self.absorbed_mla_bytes + self.lengths_bytes

    @property
    def mtp_cache_bytes(self) -> int:
        """Exactly the bytes of `MTPCache.create(...)` (latent + its own lengths); 0 without an MTP layer."""
        return self.mtp_bytes + self.lengths_bytes if self.mtp_layers else 0

    @property
    def total_with_mtp_bytes(self) -> int:
        """Main cache plus the MTP draft cache: what speculative decoding with the MTP layer allocates."""
        return self.total_bytes + self.mtp_cache_bytes

    @property
    def expanded_over_absorbed(self) -> float:
        """Expanded / absorbed MLA cache size: H * (dn + dr + dv) / latent_dim (3.1-flash: 35.56)."""
        return float(Fraction(self.expanded_values_per_token, self.latent_values_per_token))

    def table(self) -> str:
        """Human-readable per-sequence and whole-batch table."""
        b = self.batch_size
        itemsize = jnp.dtype(self.dtype).itemsize
        rule = None
        rows = [
            (f"KDA recurrent state (float32, {self.kda_layers} layers)", self.kda_state_bytes),
            (f"KDA conv windows ({self.dtype})", self.kda_conv_bytes),
            (f"MLA absorbed latent cache ({self.mla_layers} layers)", self.absorbed_mla_bytes),
            ("lengths (int32)", self.lengths_bytes),
            rule,
            ("total: main decode cache (init_cache)", self.total_bytes),
            ("MTP latent cache + lengths (not in total)", self.mtp_cache_bytes),
            ("total with MTP draft cache", self.total_with_mtp_bytes),
            rule,
            ("expanded MLA cache, for comparison (not allocated)", self.expanded_mla_bytes),
        ]
        label_width = max(len(row[0]) for row in rows if row is not rule)
        header = f"{'':<{label_width}}  {'per sequence':>14}  {f'batch of {b}':>14}"
        lines = [
            f"Decode cache budget: batch {b}, context {self.context:,} tokens, cache dtype {self.dtype}",
            f"layers: {self.kda_layers} KDA, {self.mla_layers} MLA, {self.mtp_layers} MTP",
            "",
            header,
            "-" * len(header),
        ]
        for row in rows:
            if row is rule:
                lines.append("-" * len(header))
                continue
            label, nbytes = row
            lines.append(f"{label:<{label_width}}  {format_bytes(nbytes // b):>14}  {format_bytes(nbytes):>14}")
        lines += [
            "",
            f"MLA values per token per layer: absorbed {self.latent_values_per_token} "
            f"({self.latent_values_per_token * itemsize} B), expanded {self.expanded_values_per_token} "
            f"({self.expanded_values_per_token * itemsize} B)",
            f"expanded / absorbed = {self.num_heads} * {self.expanded_values_per_token // self.num_heads} / "
            f"{self.latent_values_per_token} = {self.expanded_over_absorbed:.2f}x",
        ]
        return "\n".join(lines)


def cache_budget(config: LingConfig, batch_size: int, context: int, dtype=jnp.bfloat16) -> CacheBudget:
    """Logical decode-cache bytes of `config` for `batch_size` sequences of up to `context` tokens, caches
    (conv windows, latents) in `dtype` (a dtype or its name)."""
    for name, value in (("batch_size", batch_size), ("context", context)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    dtype = jnp.dtype(dtype)
    c = config
    kda_layers = sum(kind == KDA for kind in c.layer_types)
    mla_layers = sum(kind == MLA for kind in c.layer_types)
    mtp_layers = 1 if c.num_nextn_predict_layers else 0
    latent_per_token = c.latent_dim
    expanded_per_token = c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    latent_cache_per_layer = batch_size * context * latent_per_token * dtype.itemsize
    return CacheBudget(
        batch_size=batch_size,
        context=context,
        dtype=dtype.name,
        kda_layers=kda_layers,
        mla_layers=mla_layers,
        mtp_layers=mtp_layers,
        num_heads=c.num_attention_heads,
        latent_values_per_token=latent_per_token,
        expanded_values_per_token=expanded_per_token,
        kda_state_bytes=kda_layers * batch_size * c.num_attention_heads * c.head_dim * c.head_dim * _STATE_ITEMSIZE,
        kda_conv_bytes=kda_layers * batch_size * (c.short_conv_kernel_size - 1) * 3 * c.kda_dim * dtype.itemsize,
        absorbed_mla_bytes=mla_layers * latent_cache_per_layer,
        expanded_mla_bytes=mla_layers * batch_size * context * expanded_per_token * dtype.itemsize,
        lengths_bytes=batch_size * _LENGTHS_ITEMSIZE,
        mtp_bytes=mtp_layers * latent_cache_per_layer,
    )


def cache_bytes(cache) -> int:
    """Sum of shape x itemsize over every leaf of a cache pytree (LingCache, MTPCache, ...). Leaves may be
    arrays or the `jax.ShapeDtypeStruct`s of `jax.eval_shape`, so full-size caches can be measured without
    allocating them."""
    total = 0
    for leaf in jax.tree.leaves(cache):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(f"cache leaf {leaf!r} has no shape/dtype")
        total += math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def format_bytes(nbytes: int) -> str:
    """1023 -> '1023 B', 3 * 2**20 -> '3.00 MiB' (binary units up to TiB)."""
    if nbytes < 1024:
        return f"{nbytes} B"
    value, unit = nbytes / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if round(value, 2) < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.2f} {unit}"
