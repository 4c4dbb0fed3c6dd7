"""The Ling 3.x decoder (spec §5): embeddings, hybrid KDA/MLA layers with dense or MoE feed-forward,
final norm and lm_head, plus the MTP (next-n) draft layer.

Parameter paths mirror the checkpoint's tensor names (`model.layers.3.attention.kv_b_proj.weight` is
`model.model.layers[3].attention.kv_b_proj.weight`), so loading is a name lookup, not a translation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from ling_jax.cache import KDAState, LingCache, MLAState, MTPCache
from ling_jax.config import DENSE, KDA, MLA, MOE, LingConfig
from ling_jax.context import TokenContext, token_context
from ling_jax.kda import KimiDeltaAttention, kda_attention
from ling_jax.layers import (
    Linear,
    RMSNorm,
    SplitSum,
    Weights,
    add_rms_norm,
    linear_add_rms_norm,
    normal_param,
    params_of,
    rms_norm,
)
from ling_jax.mla import MultiLatentAttention, latent_attention
from ling_jax.moe.block import MLP, MoE, dense_mlp, moe_block_with_stats, sow_moe_stats
from ling_jax.policy import ExecutionPolicy, KDAMode, MLAMode, as_policy
from ling_jax.sharding import ACTIVATION_BTD, ACTIVATION_BTV, constrain

__all__ = [
    "DecoderLayer",
    "LingForCausalLM",
    "LingModel",
    "LingOutput",
    "MTPLayer",
    "TokenContext",
    "decoder_layer",
    "token_context",
]


@struct.dataclass
class LingOutput:
    logits: jax.Array  # [B, T, V]
    hidden: jax.Array  # [B, T, D] final-normed hidden state (the lm_head input; what MTP consumes)
    cache: LingCache | MTPCache | None = None


def decoder_layer(weights: Weights, h_BTD, state, ctx: TokenContext, cfg: LingConfig, *, layer: int):
    """One decoder layer: h [B, T, D] -> (h [B, T, D], updated state).

    weights: the layer's parameters (`input_layernorm`, `attention`, `post_attention_layernorm`, `mlp`); their
    keys say the kinds (an MLA attention has `kv_b_proj`, an MoE `gate`). state: KDAState (or None: zeros) for a
    KDA layer, MLAState or None (no cache) for an MLA layer. layer: the layer id, for the SwiGLU clip limits
    (0 for the MTP layer).
    """
    h_BTD, state, _ = decoder_layer_with_stats(weights, h_BTD, state, ctx, cfg, layer=layer)
    return h_BTD, state


def decoder_layer_with_stats(weights: Weights, h_BTD, state, ctx: TokenContext, cfg: LingConfig, *, layer: int):
    """`decoder_layer` -> (h, state, the MoE's stats or None for a dense layer; see `moe_block_with_stats`)."""
    h_BTD, y_BTD, state, stats = decoder_layer_deferred(weights, h_BTD, None, state, ctx, cfg, layer=layer)
    return residual_add(h_BTD, y_BTD), state, stats


def decoder_layer_deferred(weights: Weights, h_BTD, y_BTD, state, ctx: TokenContext, cfg: LingConfig, *, layer: int):
    """`decoder_layer_with_stats` with the residual adds at its ends left to the norms after them: the layer's input
    is h + y (y: the previous layer's feed-forward output, not yet added; None: h itself), its output h + y of the
    returned (h, y, state, stats), y the feed-forward's output. A layer loop passes each layer's (h, y) to the next
    and the last to the final norm, so every residual add runs with the norm after it (`residual_norm`). A one-token
    decode on one device leaves an MoE's y as its kernels' partial sums (`SplitSum`), which that norm adds."""
    # One device: the norms and the residual adds before them run as one kernel each on a GPU.
    eps = cfg.rms_norm_eps
    h_BTD, x = residual_norm(weights["input_layernorm"], h_BTD, y_BTD, eps, ctx.policy)
    mixer, attention = ("mla", latent_attention) if "kv_b_proj" in weights["attention"] else ("kda", kda_attention)
    with jax.named_scope(mixer):
        o_BTC, state = attention(weights["attention"], x, state, ctx, cfg, project_output=False)
    # the output projection with the residual add and norm after it: at decode sizes its split-K sums added there
    h_BTD, x = linear_add_rms_norm(
        weights["attention"]["dense"],
        o_BTC,
        h_BTD,
        weights["post_attention_layernorm"],
        eps,
        ctx.policy,
        product_scope=mixer,
    )
    stats = None
    if "gate" in weights["mlp"]:
        split_sums = ctx.decode_lengths_B is not None and jax.sharding.get_abstract_mesh().empty
        with jax.named_scope("moe"):
            y, stats = moe_block_with_stats(
                weights["mlp"], x, cfg, layer=layer, policy=ctx.policy, split_sums=split_sums
            )
        if split_sums:
            return h_BTD, SplitSum(y), state, stats
    else:
        with jax.named_scope("mlp"):
            y = dense_mlp(weights["mlp"], x, policy=ctx.policy)  # never clipped (spec §4)
    return h_BTD, constrain(y, *ACTIVATION_BTD), state, stats


def residual_add(h_BTD, y_BTD) -> jax.Array:
    """h + y, laid out as the activations: a deferred layer's output (`decoder_layer_deferred`) where no norm follows
    to take the add."""
    y_BTD = y_BTD.total(h_BTD) if isinstance(y_BTD, SplitSum) else y_BTD
    return constrain(h_BTD + y_BTD, *ACTIVATION_BTD)


def residual_norm(weights: Weights, h_BTD, y_BTD, eps: float, policy: ExecutionPolicy) -> tuple[jax.Array, jax.Array]:
    """(h + y, rms_norm of it): a residual add and the norm after it, one kernel on a GPU (`add_rms_norm`); y None:
    (h, rms_norm(h))."""
    h_BTD = constrain(h_BTD, *ACTIVATION_BTD)
    if y_BTD is None:
        return h_BTD, rms_norm(weights, h_BTD, eps, policy)
    h_BTD, x = add_rms_norm(weights, h_BTD, y_BTD, eps, policy)
    return constrain(h_BTD, *ACTIVATION_BTD), x


class DecoderLayer(nnx.Module):
    def __init__(self, config: LingConfig, *, attention: str, mlp: str, clip_layer: int, dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.clip_layer = clip_layer
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
        """`decoder_layer` with this layer's parameters; the MoE's stats are sown on `self.mlp`."""
        h_BTD, y_BTD, state = self.deferred(h_BTD, None, ctx, state)
        return residual_add(h_BTD, y_BTD), state

    def deferred(self, h_BTD, y_BTD, ctx: TokenContext, state):
        """`decoder_layer_deferred` with this layer's parameters -> (h, y, state): the layer's input is h + y (y None:
        h), its output the returned h + y; the MoE's stats are sown on `self.mlp`."""
        h_BTD, y_BTD, state, stats = decoder_layer_deferred(
            params_of(self), h_BTD, y_BTD, state, ctx, self.config, layer=self.clip_layer
        )
        if stats is not None:
            sow_moe_stats(self.mlp, stats)
        return h_BTD, y_BTD, state


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, hidden: int, *, dtype, rngs: nnx.Rngs):
        self.weight = normal_param(rngs, (vocab_size, hidden), dtype, ("vocab", "embed_table"))  # [V, D]

    def __call__(self, ids_BT):
        return jnp.take(self.weight[...], ids_BT, axis=0)


class LingModel(nnx.Module):
    def __init__(self, config: LingConfig, *, dtype, rngs: nnx.Rngs):
        self.config = config
        self.word_embeddings = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List(
            [
                DecoderLayer(config, attention=attention, mlp=mlp, clip_layer=i, dtype=dtype, rngs=rngs)
                for i, (attention, mlp) in enumerate(zip(config.layer_types, config.mlp_layer_types))
            ]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def __call__(
        self,
        input_ids_BT,
        *,
        positions=None,
        cache: LingCache | None = None,
        attention_mask=None,
        kda_mode: KDAMode | None = None,
        mla_mode: MLAMode | None = None,
        policy: ExecutionPolicy | None = None,
        inputs_embeds=None,
    ):
        """-> (final-normed hidden [B, T, D], updated cache or None). inputs_embeds [B, T, D] replaces the
        embedding lookup (the VL model's merged text + vision embeddings). policy: the execution policy
        (`model.policy`; None: `ExecutionPolicy()`); kda_mode / mla_mode override its modes for this call."""
        c = self.config
        batch, length = input_ids_BT.shape
        with jax.named_scope("embed"):
            h = self.word_embeddings(input_ids_BT) if inputs_embeds is None else inputs_embeds
        ctx = token_context(
            c,
            batch,
            length,
            positions=positions,
            attention_mask=attention_mask,
            lengths=None if cache is None else cache.lengths,
            max_length=0 if cache is None else cache.max_length,
            page_table=None if cache is None else cache.page_table,
            policy=policy,
            kda_mode=kda_mode,
            mla_mode=mla_mode,
        )
        if cache is None:
            states = [KDAState.zeros(c, batch, h.dtype) if kind == KDA else None for kind in c.layer_types]
        else:
            states = list(cache.layers)
        y = None  # each layer's feed-forward output, added with the next norm (`decoder_layer_deferred`)
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"decoder_layer_{i}"):
                h, y, states[i] = layer.deferred(h, y, ctx, states[i])
        if cache is not None:
            real = jnp.ones((batch, length), bool) if attention_mask is None else attention_mask.astype(bool)
            cache = cache.replace(layers=tuple(states), lengths=cache.lengths + real.sum(axis=1, dtype=jnp.int32))
        with jax.named_scope("final_norm"):
            return residual_norm(params_of(self.norm), h, y, c.rms_norm_eps, ctx.policy)[1], cache


class MTPLayer(DecoderLayer):
    """Next-n draft layer (spec §5): eh_proj([enorm(embed(x_{t+1})) ; hnorm(h_t)]) -> MLA + MoE layer ->
    final_layernorm; the caller applies the shared lm_head. Clip limits come from index 0, as in SGLang."""

    def __init__(self, config: LingConfig, *, dtype, rngs: nnx.Rngs):
        super().__init__(config, attention=MLA, mlp=MOE, clip_layer=0, dtype=dtype, rngs=rngs)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.eh_proj = Linear(
            2 * config.hidden_size, config.hidden_size, axes=("embed", "embed_pair"), dtype=dtype, rngs=rngs
        )
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def draft_hidden(self, embeds_BTD, hidden_BTD, ctx: TokenContext, state: MLAState | None):
        z = self.eh_proj(jnp.concatenate([self.enorm(embeds_BTD), self.hnorm(hidden_BTD)], axis=-1), ctx.policy)
        z, y, state = self.deferred(z, None, ctx, state)
        return residual_norm(params_of(self.final_layernorm), z, y, self.config.rms_norm_eps, ctx.policy)[1], state


class LingForCausalLM(nnx.Module):
    """The Ling 3.x causal LM. `model(input_ids, positions=, cache=, attention_mask=)` -> LingOutput.

    Without a cache the call is a full-sequence forward. With a cache (`init_cache`) the tokens are appended
    to it: prefill is a call with the prompt, decode a call with one token per sequence. attention_mask
    (1 = real, 0 = pad) may mark pads anywhere; pads never change real tokens' outputs or the cache.
    """

    def __init__(
        self,
        config: LingConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.bfloat16,
        policy: ExecutionPolicy | None = None,
    ):
        """policy: how the model runs (`ling_jax.policy.ExecutionPolicy`: kernel backend, KDA / MLA modes, MoE
        exchange and capacity, FP8 matmul; None: `ExecutionPolicy()`, whose "auto" backend runs the GPU / TPU kernels
        on those platforms and jnp on a CPU), as `ExecutionPolicy.for_checkpoint` makes it for config's
        quantization."""
        self.config = config
        self.dtype = dtype
        self.policy = as_policy(policy).for_checkpoint(config.quantization)
        self.model = LingModel(config, dtype=dtype, rngs=rngs)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(
                config.hidden_size, config.vocab_size, axes=("vocab", "embed"), dtype=dtype, rngs=rngs
            )
        if config.num_nextn_predict_layers:
            self.mtp = MTPLayer(config, dtype=dtype, rngs=rngs)

    def logits(self, hidden_BTD):
        with jax.named_scope("lm_head"):
            if self.config.tie_word_embeddings:
                embedding_VD = self.model.word_embeddings.weight[...].astype(hidden_BTD.dtype)
                logits_BTV = jnp.einsum("btd,vd->btv", hidden_BTD, embedding_VD)
            else:
                logits_BTV = self.lm_head(hidden_BTD, self.policy)
            return constrain(logits_BTV, *ACTIVATION_BTV)

    def __call__(
        self,
        input_ids_BT,
        *,
        positions=None,
        cache: LingCache | None = None,
        attention_mask=None,
        kda_mode: KDAMode | None = None,
        mla_mode: MLAMode | None = None,
        inputs_embeds=None,
    ) -> LingOutput:
        """inputs_embeds [B, T, D]: replaces the embedding lookup (`LingModel`; the VL model's merged embeddings)."""
        hidden, cache = self.model(
            input_ids_BT,
            positions=positions,
            cache=cache,
            attention_mask=attention_mask,
            kda_mode=kda_mode,
            mla_mode=mla_mode,
            policy=self.policy,
            inputs_embeds=inputs_embeds,
        )
        return LingOutput(logits=self.logits(hidden), hidden=hidden, cache=cache)

    def init_cache(self, batch_size: int, max_length: int, dtype=None) -> LingCache:
        """Empty caches for `batch_size` sequences of up to `max_length` tokens (dtype: activations')."""
        return LingCache.create(self.config, batch_size, max_length, dtype or self.dtype)

    def init_mtp_cache(self, batch_size: int, max_length: int, dtype=None) -> MTPCache:
        return MTPCache.create(self.config, batch_size, max_length, dtype or self.dtype)

    def draft_logits(
        self, hidden_BTD, next_ids_BT, *, positions=None, cache: MTPCache | None = None, attention_mask=None
    ) -> LingOutput:
        """MTP draft logits for token t+2 from the main model's final hidden state at t and token t+1."""
        hidden, cache = self.draft_hidden(
            hidden_BTD, next_ids_BT, positions=positions, cache=cache, attention_mask=attention_mask
        )
        return LingOutput(logits=self.logits(hidden), hidden=hidden, cache=cache)

    def draft_hidden(
        self, hidden_BTD, next_ids_BT, *, positions=None, cache: MTPCache | None = None, attention_mask=None
    ):
        """`draft_logits` without the lm_head: (MTP final hidden [B, T, D], updated MTP cache or None)."""
        if not hasattr(self, "mtp"):
            raise ValueError("this config has num_nextn_predict_layers = 0: there is no MTP layer")
        batch, length = next_ids_BT.shape
        ctx = token_context(
            self.config,
            batch,
            length,
            positions=positions,
            attention_mask=attention_mask,
            lengths=None if cache is None else cache.lengths,
            max_length=0 if cache is None else cache.layer.latent.shape[1],
            policy=self.policy,
        )
        with jax.named_scope("mtp"):
            embeds = self.model.word_embeddings(next_ids_BT)
            hidden, state = self.mtp.draft_hidden(
                embeds, hidden_BTD.astype(embeds.dtype), ctx, None if cache is None else cache.layer
            )
        if cache is not None:
            real = jnp.ones((batch, length), bool) if attention_mask is None else attention_mask.astype(bool)
            cache = MTPCache(layer=state, lengths=cache.lengths + real.sum(axis=1, dtype=jnp.int32))
        return hidden, cache
