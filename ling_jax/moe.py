"""Feed-forward blocks (spec §4): SwiGLU MLP with optional clipping, the group-limited sigmoid router and
the MoE with a shared expert. Experts are dispatched densely here (every expert sees every token and the
routing weights zero out the rest): exact, simple, and meant for small configs and tests; the grouped,
sharded dispatch lives with the sharding rules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.config import LingConfig
from ling_jax.layers import Linear, normal_param


def swiglu(gate: jax.Array, up: jax.Array, limit: float | None) -> jax.Array:
    """SiLU(gate) * up, or min(SiLU(gate), limit) * clip(up, -limit, limit) when the layer has a limit."""
    activated = jax.nn.silu(gate)
    if limit is None:
        return activated * up
    return jnp.minimum(activated, limit) * jnp.clip(up, -limit, limit)


class MLP(nnx.Module):
    """Dense SwiGLU MLP; also the shared expert."""

    def __init__(self, hidden: int, width: int, *, limit: float | None = None, dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(hidden, width, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(hidden, width, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(width, hidden, dtype=dtype, rngs=rngs)
        self.limit = limit

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


def route(x_TD, router_weight_ED, expert_bias_E, config: LingConfig):
    """Group-limited sigmoid routing. Returns (weights [T, k] fp32, expert indices [T, k] int32).

    The expert bias steers selection only; weights are the un-biased sigmoid scores, renormalised and scaled.
    """
    c = config
    logits = jnp.einsum("td,ed->te", x_TD.astype(jnp.float32), router_weight_ED.astype(jnp.float32))
    scores_TE = jax.nn.sigmoid(logits)
    choice_TE = scores_TE + expert_bias_E.astype(jnp.float32)
    if c.n_group:
        tokens = choice_TE.shape[0]
        grouped = choice_TE.reshape(tokens, c.n_group, c.num_experts // c.n_group)
        group_score_TG = jax.lax.top_k(grouped, 2)[0].sum(-1)
        _, kept_groups = jax.lax.top_k(group_score_TG, c.topk_group)
        keep_TG = jnp.zeros((tokens, c.n_group), bool).at[jnp.arange(tokens)[:, None], kept_groups].set(True)
        choice_TE = jnp.where(jnp.repeat(keep_TG, c.num_experts // c.n_group, axis=1), choice_TE, -jnp.inf)
    _, experts_TK = jax.lax.top_k(choice_TE, c.num_experts_per_tok)
    weights_TK = jnp.take_along_axis(scores_TE, experts_TK, axis=1)
    if c.norm_topk_prob:
        weights_TK = weights_TK / (weights_TK.sum(-1, keepdims=True) + 1e-20)
    return weights_TK * c.routed_scaling_factor, experts_TK.astype(jnp.int32)


class Router(nnx.Module):
    def __init__(self, config: LingConfig, *, dtype, rngs: nnx.Rngs):
        self.config = config
        self.weight = normal_param(rngs, (config.num_experts, config.hidden_size), dtype)  # [E, D]
        self.expert_bias = nnx.Param(jnp.zeros((config.num_experts,), jnp.float32))

    def __call__(self, x_TD):
        return route(x_TD, self.weight[...], self.expert_bias[...], self.config)


class Experts(nnx.Module):
    """Stacked routed experts: gate/up [E, I, D], down [E, D, I] (checkpoint layout, one slice per expert)."""

    def __init__(self, config: LingConfig, *, limit: float | None, dtype, rngs: nnx.Rngs):
        e, width, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_proj = normal_param(rngs, (e, width, hidden), dtype)
        self.up_proj = normal_param(rngs, (e, width, hidden), dtype)
        self.down_proj = normal_param(rngs, (e, hidden, width), dtype)
        self.limit = limit

    def __call__(self, x_TD, weights_TK, experts_TK):
        dtype = x_TD.dtype
        num_experts = self.gate_proj[...].shape[0]
        combine_TE = jnp.zeros((x_TD.shape[0], num_experts), jnp.float32)
        combine_TE = combine_TE.at[jnp.arange(x_TD.shape[0])[:, None], experts_TK].add(weights_TK)
        gate = jnp.einsum("td,eid->tei", x_TD, self.gate_proj[...].astype(dtype))
        up = jnp.einsum("td,eid->tei", x_TD, self.up_proj[...].astype(dtype))
        y_TED = jnp.einsum("tei,edi->ted", swiglu(gate, up, self.limit), self.down_proj[...].astype(dtype))
        return jnp.einsum("ted,te->td", y_TED, combine_TE.astype(dtype))


class MoE(nnx.Module):
    def __init__(self, config: LingConfig, *, clip_layer: int, dtype, rngs: nnx.Rngs):
        """clip_layer: the index into the SwiGLU limit lists (the layer id; 0 for the MTP layer, as SGLang)."""
        self.gate = Router(config, dtype=dtype, rngs=rngs)
        self.experts = Experts(config, limit=config.swiglu_limit(clip_layer, shared=False), dtype=dtype, rngs=rngs)
        self.shared_experts = MLP(config.hidden_size, config.shared_expert_intermediate_size,
                                  limit=config.swiglu_limit(clip_layer, shared=True), dtype=dtype, rngs=rngs)

    def __call__(self, x_BTD):
        x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
        weights, experts = self.gate(x_TD)
        routed = self.experts(x_TD, weights, experts)
        return (routed + self.shared_experts(x_TD)).reshape(x_BTD.shape)
