"""Feed-forward blocks (spec §4): SwiGLU MLP with optional clipping, the group-limited sigmoid router and
the MoE with a shared expert. Routed experts run as grouped matmuls over the rows routed to them (dropless),
on one device or expert-parallel across a mesh (`ling_jax.expert_parallel`); `dense_expert_ffn` is the
one-hot baseline.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.config import LingConfig
from ling_jax.expert_ffn import SharedExpert, expert_load, local_moe, swiglu_ffn
from ling_jax.expert_parallel import moe_parallel, uses_model_parallelism
from ling_jax.layers import Linear, normal_param, param
from pallas_kernels.backend import resolve_backend
from pallas_kernels.moe.ops import RoutingRule, select_experts


class MLP(nnx.Module):
    """Dense SwiGLU MLP; also the shared expert."""

    def __init__(self, hidden: int, width: int, *, limit: float | None = None, dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(hidden, width, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.up_proj = Linear(hidden, width, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.down_proj = Linear(width, hidden, axes=("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.limit = limit

    def weights(self) -> SharedExpert:
        return SharedExpert(self.gate_proj.weight[...], self.up_proj.weight[...], self.down_proj.weight[...],
                            self.limit)

    def __call__(self, x: jax.Array) -> jax.Array:
        return swiglu_ffn(x, *self.weights())


def routing_rule(config: LingConfig) -> RoutingRule:
    c = config
    return RoutingRule(top_k=c.num_experts_per_tok, n_group=c.n_group, topk_group=c.topk_group,
                       norm_topk_prob=c.norm_topk_prob, scaling=c.routed_scaling_factor)


def route(x_TD, router_weight_ED, expert_bias_E, config: LingConfig, *, backend: str = "reference"):
    """Group-limited sigmoid routing. Returns (weights [T, k] fp32, expert indices [T, k] int32).

    The router logits are fp32: products of the inputs as given, accumulated in fp32 (bf16 activations and
    weights run as one bf16 matmul: their products are exact in fp32, and no fp32 copy of x is made). The
    selection is `pallas_kernels.moe.routing.select_experts` (one kernel on a GPU). The expert bias steers
    selection only; weights are the un-biased sigmoid scores, renormalised and scaled.
    """
    logits_TE = jnp.einsum("td,ed->te", x_TD, router_weight_ED, preferred_element_type=jnp.float32)
    return select_experts(logits_TE, expert_bias_E, routing_rule(config), backend=backend)


class Router(nnx.Module):
    def __init__(self, config: LingConfig, *, dtype, rngs: nnx.Rngs):
        self.config = config
        self.weight = normal_param(rngs, (config.num_experts, config.hidden_size), dtype, ("router", "embed"))  # [E, D]
        self.expert_bias = param(jnp.zeros((config.num_experts,), jnp.float32), ("router",))

    def __call__(self, x_TD, *, backend: str = "reference"):
        return route(x_TD, self.weight[...], self.expert_bias[...], self.config, backend=backend)


class Experts(nnx.Module):
    """Stacked routed experts: gate/up [E, I, D], down [E, D, I] (checkpoint layout, one slice per expert).

    Under a mesh that splits the experts or their width (`jax.set_mesh`; the `experts` / `expert_mlp` rules),
    tokens go to the devices that own their experts (`ling_jax.expert_parallel`); otherwise all experts run here
    as one grouped FFN.
    capacity_factor None is dropless; a number caps each device's rows per source (see expert_parallel);
    all_to_all: how the rows move between devices (`LingConfig.moe_all_to_all`).
    """

    def __init__(self, config: LingConfig, *, limit: float | None, dtype, rngs: nnx.Rngs):
        e, width, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_proj = normal_param(rngs, (e, width, hidden), dtype, ("experts", "expert_mlp", "embed"))
        self.up_proj = normal_param(rngs, (e, width, hidden), dtype, ("experts", "expert_mlp", "embed"))
        self.down_proj = normal_param(rngs, (e, hidden, width), dtype, ("experts", "embed", "expert_mlp"))
        self.limit = limit

    def __call__(self, x_TD, weights_TK, experts_TK, *, backend: str = "reference",
                 capacity_factor: float | None = None, all_to_all: str = "auto",
                 shared: SharedExpert | None = None):
        """-> (y [T, D], dropped token-assignments: int32 scalar, 0 when dropless). With `shared`, y includes the
        shared expert's output (on one device a GPU decode step runs it inside the routed experts' kernels)."""
        weights = (self.gate_proj[...], self.up_proj[...], self.down_proj[...])
        mesh = jax.sharding.get_abstract_mesh()
        if uses_model_parallelism(mesh):
            with jax.named_scope("routed_experts"):
                routed, dropped = moe_parallel(x_TD, weights_TK, experts_TK, *weights, limit=self.limit, mesh=mesh,
                                               capacity_factor=capacity_factor, backend=backend, exchange=all_to_all)
            if shared is None:
                return routed, dropped
            with jax.named_scope("shared_expert"):
                shared_TD = swiglu_ffn(x_TD, *shared)
            return routed + shared_TD, dropped
        return local_moe(x_TD, weights_TK, experts_TK, *weights, self.limit, backend=backend,
                         shared=shared), jnp.int32(0)


class MoE(nnx.Module):
    """Routed experts + shared expert. Under `nnx.capture(..., nnx.Intermediate)` each call sows
    `expert_load` [E] (token-assignments per expert) and `dropped_assignments` (0 unless a capacity factor
    is set)."""

    def __init__(self, config: LingConfig, *, clip_layer: int, dtype, rngs: nnx.Rngs):
        """clip_layer: the index into the SwiGLU limit lists (the layer id; 0 for the MTP layer, as SGLang)."""
        self.gate = Router(config, dtype=dtype, rngs=rngs)
        self.experts = Experts(config, limit=config.swiglu_limit(clip_layer, shared=False), dtype=dtype, rngs=rngs)
        self.shared_experts = MLP(config.hidden_size, config.shared_expert_intermediate_size,
                                  limit=config.swiglu_limit(clip_layer, shared=True), dtype=dtype, rngs=rngs)
        self.capacity_factor = config.moe_capacity_factor
        self.all_to_all = config.moe_all_to_all

    def __call__(self, x_BTD, *, kernel_backend: str = "reference"):
        x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
        backend = resolve_backend(kernel_backend)
        with jax.named_scope("moe_router"):
            weights, experts = self.gate(x_TD, backend=backend)
        y_TD, dropped = self.experts(x_TD, weights, experts, backend=backend, capacity_factor=self.capacity_factor,
                                     all_to_all=self.all_to_all, shared=self.shared_experts.weights())
        if hasattr(self, "__captures__"):  # inside nnx.capture; sowing elsewhere would grow module state
            self.sow(nnx.Intermediate, "expert_load", expert_load(experts, self.gate.config.num_experts))
            self.sow(nnx.Intermediate, "dropped_assignments", dropped)
        return y_TD.reshape(x_BTD.shape)
