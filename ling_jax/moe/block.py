"""Feed-forward blocks (spec §4): SwiGLU MLP with optional clipping, the group-limited sigmoid router and
the MoE with a shared expert. Routed experts run as grouped matmuls over the rows routed to them (dropless),
on one device or expert-parallel across a mesh (`ling_jax.moe.expert_parallel`); `dense_expert_ffn` is the
one-hot baseline.

Each block is a pure function of its weights (`dense_mlp`, `router`, `moe_block`); the modules hold the
parameters and call them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.config import LingConfig
from ling_jax.layers import Linear, Weights, normal_param, param, params_of
from ling_jax.moe.expert_parallel import moe_parallel, uses_model_parallelism
from ling_jax.moe.experts import SharedExpert, expert_load, local_moe, swiglu_ffn
from ling_jax.policy import ExecutionPolicy, as_policy
from ling_jax.sharding import per_shard
from pallas_kernels.backend import resolve_backend
from pallas_kernels.moe.ops import ExpertWeights, Routing, RoutingRule, select_experts


def shared_expert(weights: Weights, limit: float | None) -> SharedExpert:
    """A SwiGLU block's weights ({gate,up,down}_proj) with its clip."""
    return SharedExpert(
        weights["gate_proj"]["weight"], weights["up_proj"]["weight"], weights["down_proj"]["weight"], limit
    )


def dense_mlp(
    weights: Weights, x: jax.Array, *, limit: float | None = None, policy: ExecutionPolicy | None = None
) -> jax.Array:
    """The dense SwiGLU MLP (also the shared expert): down(swiglu(gate(x), up(x), limit)); policy: how block-FP8
    weights multiply (`swiglu_ffn`)."""
    return swiglu_ffn(x, *shared_expert(weights, limit).weights, limit, policy)


def routing_rule(config: LingConfig) -> RoutingRule:
    c = config
    return RoutingRule(
        top_k=c.num_experts_per_tok,
        n_group=c.n_group,
        topk_group=c.topk_group,
        norm_topk_prob=c.norm_topk_prob,
        scaling=c.routed_scaling_factor,
    )


def route(x_TD, router_weight_ED, expert_bias_E, config: LingConfig, *, policy: ExecutionPolicy | None = None):
    """Group-limited sigmoid routing. Returns (weights [T, k] fp32, expert indices [T, k] int32); policy: the
    kernel backend of the selection (None: `ExecutionPolicy()`).

    The router logits are fp32: products of the inputs as given, accumulated in fp32 (bf16 activations and
    weights run as one bf16 matmul: their products are exact in fp32, and no fp32 copy of x is made). The
    selection is `pallas_kernels.moe.select_experts` (one kernel on a GPU). The expert bias steers
    selection only; weights are the un-biased sigmoid scores, renormalised and scaled.
    """
    logits_TE = jnp.einsum("td,ed->te", x_TD, router_weight_ED, preferred_element_type=jnp.float32)
    backend = resolve_backend(as_policy(policy).kernel_backend)
    select = functools.partial(select_experts, rule=routing_rule(config), backend=backend)
    tokens = ("activation_batch", None)
    return per_shard(select, in_axes=(tokens, None), out_axes=(tokens, tokens))(logits_TE, expert_bias_E)


def router(weights: Weights, x_TD, cfg: LingConfig, *, policy: ExecutionPolicy | None = None):
    """`route` with the MoE's `gate` parameters (`weight` [E, D], `expert_bias` [E])."""
    return route(x_TD, weights["weight"], weights["expert_bias"], cfg, policy=policy)


def routed_experts_block(
    weights: Weights,
    x_TD,
    routing: Routing,
    *,
    limit: float | None,
    policy: ExecutionPolicy,
    shared: SharedExpert | None = None,
    split_sums: bool = False,
):
    """The routed experts (`gate_proj` / `up_proj` [E, I, D], `down_proj` [E, D, I]) on the rows routed to them
    -> (y [T, D], dropped token-assignments: int32 scalar, 0 when dropless). With `shared`, y includes the
    shared expert's output (on one device a GPU decode step runs it inside the routed experts' kernels).
    split_sums: y as [S, T, D] partial sums (`local_moe`'s; one split under expert parallelism).

    Under a mesh that splits the experts or their width (`jax.set_mesh`; the `experts` / `expert_mlp` rules),
    tokens go to the devices that own their experts (`ling_jax.moe.expert_parallel`); otherwise all experts run here
    as one grouped FFN."""
    experts = ExpertWeights(weights["gate_proj"], weights["up_proj"], weights["down_proj"])
    mesh = jax.sharding.get_abstract_mesh()
    if uses_model_parallelism(mesh):
        with jax.named_scope("routed_experts"):
            routed, dropped = moe_parallel(x_TD, routing, experts, limit=limit, mesh=mesh, policy=policy)
        if shared is None:
            return routed, dropped
        with jax.named_scope("shared_expert"):
            shared_TD = swiglu_ffn(x_TD, *shared.weights, shared.limit, policy)
        return ((routed + shared_TD)[None] if split_sums else routed + shared_TD), dropped
    return local_moe(x_TD, routing, experts, limit, policy=policy, shared=shared, split_sums=split_sums), jnp.int32(0)


def moe_block(weights: Weights, x_BTD, cfg: LingConfig, *, layer: int, policy: ExecutionPolicy | None = None):
    """The MoE feed-forward: x [B, T, D] -> y [B, T, D], routed experts plus the shared expert.

    weights: the layer's `mlp` parameters (`gate`, `experts` stacked [E, ...], `shared_experts`); layer: the
    index into the SwiGLU clip lists (0 for the MTP layer); policy: kernel backend, exchange and capacity
    (None: `ExecutionPolicy()`).
    """
    return moe_block_with_stats(weights, x_BTD, cfg, layer=layer, policy=policy)[0]


def moe_block_with_stats(
    weights: Weights,
    x_BTD,
    cfg: LingConfig,
    *,
    layer: int,
    policy: ExecutionPolicy | None = None,
    split_sums: bool = False,
):
    """`moe_block` -> (y [B, T, D], {"expert_load": [E] assignments per expert, "dropped_assignments": int32}).
    split_sums: y as partial sums [S, B x T, D] that add up to it (`routed_experts_block`'s), for the norm after
    the layer to add (`ling_jax.layers.SplitSum`)."""
    policy = as_policy(policy)
    x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
    with jax.named_scope("moe_router"):
        weights_TK, experts_TK = router(weights["gate"], x_TD, cfg, policy=policy)
    shared = shared_expert(weights["shared_experts"], cfg.swiglu_limit(layer, shared=True))
    y_TD, dropped = routed_experts_block(
        weights["experts"],
        x_TD,
        Routing(weights_TK, experts_TK),
        limit=cfg.swiglu_limit(layer, shared=False),
        policy=policy,
        shared=shared,
        split_sums=split_sums,
    )
    stats = {"expert_load": expert_load(experts_TK, cfg.num_experts), "dropped_assignments": dropped}
    return (y_TD if split_sums else y_TD.reshape(x_BTD.shape)), stats


def sow_moe_stats(module: nnx.Module, stats) -> None:
    """Record `moe_block_with_stats`' counts on `module`, inside `nnx.capture(..., nnx.Intermediate)` only
    (sowing elsewhere would grow module state)."""
    if hasattr(module, "__captures__"):
        for name, value in stats.items():
            module.sow(nnx.Intermediate, name, value)


class MLP(nnx.Module):
    """Dense SwiGLU MLP; also the shared expert."""

    def __init__(self, hidden: int, width: int, *, limit: float | None = None, dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(hidden, width, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.up_proj = Linear(hidden, width, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.down_proj = Linear(width, hidden, axes=("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.limit = limit

    def __call__(self, x: jax.Array) -> jax.Array:
        return dense_mlp(params_of(self), x, limit=self.limit)


class Router(nnx.Module):
    def __init__(self, config: LingConfig, *, dtype, rngs: nnx.Rngs):
        self.config = config
        self.weight = normal_param(rngs, (config.num_experts, config.hidden_size), dtype, ("router", "embed"))  # [E, D]
        self.expert_bias = param(jnp.zeros((config.num_experts,), jnp.float32), ("router",))

    def __call__(self, x_TD, *, policy: ExecutionPolicy | None = None):
        return router(params_of(self), x_TD, self.config, policy=policy)


class Experts(nnx.Module):
    """Stacked routed experts: gate/up [E, I, D], down [E, D, I] (checkpoint layout, one slice per expert; each
    may be a quantised weight with per-expert scales, `ling_jax.quantized`); `routed_experts_block`.
    capacity_factor None is dropless; a number caps each device's rows per source (see expert_parallel);
    exchange: how the rows move between devices (`ExecutionPolicy.moe_exchange`).
    """

    def __init__(self, config: LingConfig, *, limit: float | None, dtype, rngs: nnx.Rngs):
        e, width, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
        gate_up, down = ("experts", "expert_mlp", "embed"), ("experts", "embed", "expert_mlp")
        self.gate_proj = normal_param(rngs, (e, width, hidden), dtype, gate_up, quantizable=True)
        self.up_proj = normal_param(rngs, (e, width, hidden), dtype, gate_up, quantizable=True)
        self.down_proj = normal_param(rngs, (e, hidden, width), dtype, down, quantizable=True)
        self.limit = limit

    def __call__(
        self, x_TD, routing: Routing, *, policy: ExecutionPolicy | None = None, shared: SharedExpert | None = None
    ):
        return routed_experts_block(
            params_of(self), x_TD, routing, limit=self.limit, policy=as_policy(policy), shared=shared
        )


class MoE(nnx.Module):
    """Routed experts + shared expert (`moe_block`). Under `nnx.capture(..., nnx.Intermediate)` each call sows
    `expert_load` [E] (token-assignments per expert) and `dropped_assignments` (0 unless a capacity factor
    is set)."""

    def __init__(self, config: LingConfig, *, clip_layer: int, dtype, rngs: nnx.Rngs):
        """clip_layer: the index into the SwiGLU limit lists (the layer id; 0 for the MTP layer, as SGLang)."""
        self.config = config
        self.clip_layer = clip_layer
        self.gate = Router(config, dtype=dtype, rngs=rngs)
        self.experts = Experts(config, limit=config.swiglu_limit(clip_layer, shared=False), dtype=dtype, rngs=rngs)
        self.shared_experts = MLP(
            config.hidden_size,
            config.shared_expert_intermediate_size,
            limit=config.swiglu_limit(clip_layer, shared=True),
            dtype=dtype,
            rngs=rngs,
        )

    def __call__(self, x_BTD, *, policy: ExecutionPolicy | None = None):
        """policy: kernel backend, exchange and capacity (None: `ExecutionPolicy()`)."""
        y_BTD, stats = moe_block_with_stats(params_of(self), x_BTD, self.config, layer=self.clip_layer, policy=policy)
        sow_moe_stats(self, stats)
        return y_BTD
