"""The Ling 3.x decoder (spec §5): embeddings, hybrid KDA/MLA layers with dense or MoE feed-forward,
final norm and lm_head, plus the MTP (next-n) draft layer.

Parameter paths mirror the checkpoint's tensor names (`model.layers.3.attention.kv_b_proj.weight` is
`model.model.layers[3].attention.kv_b_proj.weight`), so loading is a name lookup, not a translation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

from ling_jax.cache import KDAState, LingCache, MLAState, MTPCache
from ling_jax.config import DENSE, KDA, MLA, MOE, LingConfig
from ling_jax.kda import CHUNKED, RECURRENT, KimiDeltaAttention
from ling_jax.layers import Linear, RMSNorm, normal_param
from ling_jax.mla import ABSORBED, EXPANDED, KeyVisibility, MultiLatentAttention
from ling_jax.moe import MLP, MoE
from ling_jax.rope import rope_cos_sin
from ling_jax.sharding import ACTIVATION_BTD, ACTIVATION_BTV, constrain


@struct.dataclass
class LingOutput:
    logits: jax.Array  # [B, T, V]
    hidden: jax.Array  # [B, T, D] final-normed hidden state (the lm_head input; what MTP consumes)
    cache: LingCache | MTPCache | None = None


@dataclasses.dataclass(frozen=True)
class TokenContext:
    """Everything a layer needs to know about the T tokens of one call besides their hidden states."""

    mask_BT: jax.Array | None  # real (True) vs pad tokens; None = all real
    cos: jax.Array  # [B, T, rope_dim / 2]
    sin: jax.Array
    slots_BT: jax.Array | None  # cache slot per token (pads: out of range, dropped); None without a cache
    visibility: KeyVisibility  # which keys (cache slots, or the T tokens themselves) each query may see
    kda_mode: str
    mla_mode: str
    decode_lengths_B: jax.Array | None  # one-token decode over a cache: the visible prefix per sequence
    kernel_backend: str  # pallas_kernels backend for decode ("auto", "reference", "pallas_gpu", ...)


def token_context(config: LingConfig, batch: int, length: int, *, positions, attention_mask, lengths,
                  max_length, kda_mode, mla_mode, kernel_backend: str = "auto") -> TokenContext:
    """Masks, slots and RoPE tables for a call; `lengths` is the cache's [B] token count, or None."""
    mask = None if attention_mask is None else attention_mask.astype(bool)
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
        visibility = KeyVisibility(jnp.where(real, slots_real, -1),
                                   jnp.arange(max_length)[None, :] < new_lengths[:, None])
        default_positions = jnp.maximum(slots_real, 0)
        if length == 1:
            decode_lengths = new_lengths
    if positions is None:
        positions = default_positions
    positions = jnp.asarray(positions)
    shape = (batch, length, 3) if positions.ndim == 3 else (batch, length)  # [B, T, 3]: VL (t, h, w) positions
    cos, sin = rope_cos_sin(jnp.broadcast_to(positions, shape), config)
    if kda_mode is None:
        kda_mode = RECURRENT if length == 1 else CHUNKED
    if mla_mode is None:
        mla_mode = ABSORBED if (length == 1 and lengths is not None) else EXPANDED
    return TokenContext(mask, cos, sin, slots, visibility, kda_mode, mla_mode, decode_lengths, kernel_backend)


class DecoderLayer(nnx.Module):
    def __init__(self, config: LingConfig, *, attention: str, mlp: str, clip_layer: int, dtype, rngs: nnx.Rngs):
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        if attention == KDA:
            self.attention = KimiDeltaAttention(c, dtype=dtype, rngs=rngs)
        else:
            self.attention = MultiLatentAttention(c, dtype=dtype, rngs=rngs)
        if mlp == DENSE:
            self.mlp = MLP(c.hidden_size, c.intermediate_size, dtype=dtype, rngs=rngs)  # never clipped (spec §4)
        else:
            self.mlp = MoE(c, clip_layer=clip_layer, dtype=dtype, rngs=rngs)

    def __call__(self, h_BTD, ctx: TokenContext, state):
        """state: KDAState for a KDA layer; MLAState or None (no cache) for an MLA layer."""
        # One device: the norms (and the residual add before the second) run as one kernel each on a GPU.
        norm_backend = ctx.kernel_backend if jax.sharding.get_abstract_mesh().empty else "reference"
        h_BTD = constrain(h_BTD, *ACTIVATION_BTD)
        x = self.input_layernorm(h_BTD, backend=norm_backend)
        if isinstance(self.attention, KimiDeltaAttention):
            with jax.named_scope("kda"):
                y, state = self.attention(x, state, ctx.mask_BT, mode=ctx.kda_mode, kernel_backend=ctx.kernel_backend)
        else:
            with jax.named_scope("mla"):
                y, state = self._latent_attention(x, ctx, state)
        h_BTD, x = self.post_attention_layernorm.add_and_normalize(h_BTD, constrain(y, *ACTIVATION_BTD),
                                                                   backend=norm_backend)
        if isinstance(self.mlp, MoE):
            with jax.named_scope("moe"):
                y = self.mlp(x, kernel_backend=ctx.kernel_backend)
        else:
            with jax.named_scope("mlp"):
                y = self.mlp(x)
        return constrain(h_BTD + constrain(y, *ACTIVATION_BTD), *ACTIVATION_BTD), state

    def _latent_attention(self, x, ctx: TokenContext, state: MLAState | None):
        latent_BTA = self.attention.latent(x, ctx.cos, ctx.sin)
        if state is None:
            keys = latent_BTA
        else:
            rows = jnp.arange(x.shape[0])[:, None]
            keys = state.latent.at[rows, ctx.slots_BT].set(latent_BTA.astype(state.latent.dtype), mode="drop")
            state = MLAState(latent=keys)
        y = self.attention(x, ctx.cos, ctx.sin, keys_BSA=keys, visibility=ctx.visibility, mode=ctx.mla_mode,
                           decode_lengths_B=ctx.decode_lengths_B, kernel_backend=ctx.kernel_backend)
        return y, state


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, hidden: int, *, dtype, rngs: nnx.Rngs):
        self.weight = normal_param(rngs, (vocab_size, hidden), dtype, ("vocab", "embed_table"))  # [V, D]

    def __call__(self, ids_BT):
        return jnp.take(self.weight[...], ids_BT, axis=0)


class LingModel(nnx.Module):
    def __init__(self, config: LingConfig, *, dtype, rngs: nnx.Rngs):
        self.config = config
        self.word_embeddings = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([
            DecoderLayer(config, attention=attention, mlp=mlp, clip_layer=i, dtype=dtype, rngs=rngs)
            for i, (attention, mlp) in enumerate(zip(config.layer_types, config.mlp_layer_types))])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def __call__(self, input_ids_BT, *, positions=None, cache: LingCache | None = None, attention_mask=None,
                 kda_mode: str | None = None, mla_mode: str | None = None, kernel_backend: str = "auto",
                 inputs_embeds=None):
        """-> (final-normed hidden [B, T, D], updated cache or None). inputs_embeds [B, T, D] replaces the
        embedding lookup (the VL model's merged text + vision embeddings)."""
        c = self.config
        batch, length = input_ids_BT.shape
        with jax.named_scope("embed"):
            h = self.word_embeddings(input_ids_BT) if inputs_embeds is None else inputs_embeds
        ctx = token_context(c, batch, length, positions=positions, attention_mask=attention_mask,
                            lengths=None if cache is None else cache.lengths,
                            max_length=0 if cache is None else cache.max_length,
                            kda_mode=kda_mode, mla_mode=mla_mode, kernel_backend=kernel_backend)
        if cache is None:
            states = [KDAState.zeros(c, batch, h.dtype) if kind == KDA else None for kind in c.layer_types]
        else:
            states = list(cache.layers)
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"decoder_layer_{i}"):
                h, states[i] = layer(h, ctx, states[i])
        if cache is not None:
            real = jnp.ones((batch, length), bool) if attention_mask is None else attention_mask.astype(bool)
            cache = LingCache(layers=tuple(states), lengths=cache.lengths + real.sum(axis=1, dtype=jnp.int32))
        with jax.named_scope("final_norm"):
            return self.norm(h), cache


class MTPLayer(DecoderLayer):
    """Next-n draft layer (spec §5): eh_proj([enorm(embed(x_{t+1})) ; hnorm(h_t)]) -> MLA + MoE layer ->
    final_layernorm; the caller applies the shared lm_head. Clip limits come from index 0, as in SGLang."""

    def __init__(self, config: LingConfig, *, dtype, rngs: nnx.Rngs):
        super().__init__(config, attention=MLA, mlp=MOE, clip_layer=0, dtype=dtype, rngs=rngs)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.eh_proj = Linear(2 * config.hidden_size, config.hidden_size, axes=("embed", "embed_pair"), dtype=dtype,
                              rngs=rngs)
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def draft_hidden(self, embeds_BTD, hidden_BTD, ctx: TokenContext, state: MLAState | None):
        z = self.eh_proj(jnp.concatenate([self.enorm(embeds_BTD), self.hnorm(hidden_BTD)], axis=-1))
        z, state = self(z, ctx, state)
        return self.final_layernorm(z), state


class LingForCausalLM(nnx.Module):
    """The Ling 3.x causal LM. `model(input_ids, positions=, cache=, attention_mask=)` -> LingOutput.

    Without a cache the call is a full-sequence forward. With a cache (`init_cache`) the tokens are appended
    to it: prefill is a call with the prompt, decode a call with one token per sequence. attention_mask
    (1 = real, 0 = pad) may mark pads anywhere; pads never change real tokens' outputs or the cache.
    """

    def __init__(self, config: LingConfig, *, rngs: nnx.Rngs, dtype=jnp.bfloat16, kernel_backend: str = "auto"):
        """kernel_backend: Pallas kernels for decode ("auto": GPU/TPU kernels on those platforms, jnp on CPU;
        "reference", "pallas_gpu", "pallas_tpu", or "interpret_gpu" / "interpret_tpu" for CPU tests)."""
        self.config = config
        self.dtype = dtype
        self.kernel_backend = kernel_backend
        self.model = LingModel(config, dtype=dtype, rngs=rngs)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, axes=("vocab", "embed"), dtype=dtype,
                                  rngs=rngs)
        if config.num_nextn_predict_layers:
            self.mtp = MTPLayer(config, dtype=dtype, rngs=rngs)

    def logits(self, hidden_BTD):
        with jax.named_scope("lm_head"):
            if self.config.tie_word_embeddings:
                embedding_VD = self.model.word_embeddings.weight[...].astype(hidden_BTD.dtype)
                logits_BTV = jnp.einsum("btd,vd->btv", hidden_BTD, embedding_VD)
            else:
                logits_BTV = self.lm_head(hidden_BTD)
            return constrain(logits_BTV, *ACTIVATION_BTV)

    def __call__(self, input_ids_BT, *, positions=None, cache: LingCache | None = None, attention_mask=None,
                 kda_mode: str | None = None, mla_mode: str | None = None) -> LingOutput:
        hidden, cache = self.model(input_ids_BT, positions=positions, cache=cache, attention_mask=attention_mask,
                                   kda_mode=kda_mode, mla_mode=mla_mode, kernel_backend=self.kernel_backend)
        return LingOutput(logits=self.logits(hidden), hidden=hidden, cache=cache)

    def init_cache(self, batch_size: int, max_length: int, dtype=None) -> LingCache:
        """Empty caches for `batch_size` sequences of up to `max_length` tokens (dtype: activations')."""
        return LingCache.create(self.config, batch_size, max_length, dtype or self.dtype)

    def init_mtp_cache(self, batch_size: int, max_length: int, dtype=None) -> MTPCache:
        return MTPCache.create(self.config, batch_size, max_length, dtype or self.dtype)

    def draft_logits(self, hidden_BTD, next_ids_BT, *, positions=None, cache: MTPCache | None = None,
                     attention_mask=None) -> LingOutput:
        """MTP draft logits for token t+2 from the main model's final hidden state at t and token t+1."""
        hidden, cache = self.draft_hidden(hidden_BTD, next_ids_BT, positions=positions, cache=cache,
                                          attention_mask=attention_mask)
        return LingOutput(logits=self.logits(hidden), hidden=hidden, cache=cache)

    def draft_hidden(self, hidden_BTD, next_ids_BT, *, positions=None, cache: MTPCache | None = None,
                     attention_mask=None):
        """`draft_logits` without the lm_head: (MTP final hidden [B, T, D], updated MTP cache or None)."""
        if not hasattr(self, "mtp"):
            raise ValueError("this config has num_nextn_predict_layers = 0: there is no MTP layer")
        batch, length = next_ids_BT.shape
        ctx = token_context(self.config, batch, length, positions=positions, attention_mask=attention_mask,
                            lengths=None if cache is None else cache.lengths,
                            max_length=0 if cache is None else cache.layer.latent.shape[1],
                            kda_mode=None, mla_mode=None, kernel_backend=self.kernel_backend)
        with jax.named_scope("mtp"):
            embeds = self.model.word_embeddings(next_ids_BT)
            hidden, state = self.mtp.draft_hidden(embeds, hidden_BTD.astype(embeds.dtype), ctx,
                                                  None if cache is None else cache.layer)
        if cache is not None:
            real = jnp.ones((batch, length), bool) if attention_mask is None else attention_mask.astype(bool)
            cache = MTPCache(layer=state, lengths=cache.lengths + real.sum(axis=1, dtype=jnp.int32))
        return hidden, cache
