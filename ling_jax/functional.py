"""The model's layers as pure functions, for research code that calls `jax.jit` itself.

One signature per layer kind; `weights` is the layer's parameters as a nested dict of arrays keyed like the
checkpoint's tensor names (routed experts stacked [E, ...]); `cfg` is the `LingConfig` (hashable, so it can be
static: `jax.jit(fn, static_argnames="cfg")`); `ctx` is the call's `TokenContext` (`token_context`: masks,
cache slots, RoPE tables and the `ExecutionPolicy`), a pytree.

    kda_attention(weights, x_BTD, state, ctx, cfg) -> (y_BTD, state)
    latent_attention(weights, x_BTD, cache, ctx, cfg) -> (y_BTD, cache)    # the cache write inside
    moe_block(weights, x_BTD, cfg, *, layer, policy=None) -> y_BTD
    dense_mlp(weights, x, *, limit=None) -> y
    decoder_layer(weights, h_BTD, state, ctx, cfg, *, layer) -> (h_BTD, state)
    rms_norm(weights, x, eps), router(weights, x_TD, cfg) -> (weights_TK, experts_TK),
    rope_cos_sin(positions_BT, cfg) -> (cos, sin), apply_rope(x, cos, sin, interleave=)

These are the functions the NNX modules call (`ling_jax.model`, `kda`, `mla`, `moe`, `layers`): there is one
implementation. `layer_weights` takes a layer's weights from a model;
`ling_jax.checkpoints.hf.checkpoint_layer_weights` reads them from a HF checkpoint directory (that layer's
tensors only).
"""

from __future__ import annotations

from ling_jax.context import KeyVisibility, TokenContext, token_context
from ling_jax.kda import kda_attention
from ling_jax.layers import Weights, gated_rms_norm, linear, params_of, rms_norm
from ling_jax.mla import latent_attention, mla_latent
from ling_jax.model import LingForCausalLM, decoder_layer
from ling_jax.moe.block import dense_mlp, moe_block, router
from ling_jax.policy import ExecutionPolicy, KDAMode, KernelBackend, MLAMode, MoEExchange
from ling_jax.rope import apply_rope, rope_cos_sin

__all__ = [
    "ExecutionPolicy",
    "KDAMode",
    "KernelBackend",
    "KeyVisibility",
    "MLAMode",
    "MoEExchange",
    "TokenContext",
    "Weights",
    "apply_rope",
    "decoder_layer",
    "dense_mlp",
    "gated_rms_norm",
    "kda_attention",
    "latent_attention",
    "layer_weights",
    "linear",
    "mla_latent",
    "moe_block",
    "rms_norm",
    "rope_cos_sin",
    "router",
    "token_context",
]


def layer_weights(model: LingForCausalLM, index: int) -> Weights:
    """Decoder layer `index`'s weights from a model (`decoder_layer`'s `weights`): the arrays themselves, no copy."""
    layers = model.model.layers
    if not 0 <= index < len(layers):
        raise IndexError(f"layer_weights: layer {index} of a model with {len(layers)} decoder layers")
    return params_of(layers[index])
