"""Expert selection on GPU (`select_experts_reference`'s picks, exactly, ties included, and its weights up to
fp32 rounding): one Pallas kernel (Triton lowering), one token a program, where XLA runs a sort and about eight
small fusions per layer: what a one-token decode step pays in launches.

At decode sizes the kernel's time is the latency of its whole-row reductions, one after the other in one warp,
so it is written for few of them. The E logits come as a [G, P] tile, expert g * P + p at (g, p) (the G groups
and P experts a group each padded to a power of two, padding masked): the group scores (each group's two best)
are three reductions along P for all groups at once, their ranking one over a [G, G] comparison, and each of the
top_k picks one argmax (Triton's (value, index) reduction: the largest choice and its lowest index, i.e. the
lowest expert among equals); the picks' scores come after the loop, in one [slots, E] reduction.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.moe import tuned
from pallas_kernels.moe.reference import RoutingRule
from pallas_kernels.tuning import lookup


def _group_tile(num_experts: int, rule: RoutingRule) -> tuple[int, int, int, int]:
    """(groups, experts a group, both padded to powers of two): no groups is one group of all experts."""
    groups = rule.n_group or 1
    per_group = num_experts // groups
    return groups, per_group, pl.next_power_of_2(groups), pl.next_power_of_2(per_group)


def _kept_groups(choice_GP, topk_group: int):
    """[G, 1] bool: the topk_group groups with the largest sum of their two best choices, ties to the lower group
    (`reference.kept_groups`); padded groups (all -inf) rank last."""
    groups, per_group = choice_GP.shape
    member_P = jnp.arange(per_group)
    first_G = jnp.argmax(choice_GP, axis=1)
    second_G = jnp.max(jnp.where(member_P[None, :] == first_G[:, None], -jnp.inf, choice_GP), axis=1)
    score_G = jnp.max(choice_GP, axis=1) + second_G
    group_G = jnp.arange(groups)
    score_G1, score_1H = score_G[:, None], score_G[None, :]
    ahead_GH = (score_1H > score_G1) | ((score_1H == score_G1) & (group_G[None, :] < group_G[:, None]))
    return (jnp.sum(ahead_GH.astype(jnp.int32), axis=1) < topk_group)[:, None]


def _kernel(logits_ref, bias_ref, weights_ref, experts_ref, *, rule: RoutingRule, groups: int, per_group: int):
    padded_groups, padded_per_group = logits_ref.shape
    slots = weights_ref.shape[0]
    group_G1 = jnp.arange(padded_groups)[:, None]
    member_1P = jnp.arange(padded_per_group)[None, :]
    scores_GP = jax.nn.sigmoid(logits_ref[...])
    valid_GP = (group_G1 < groups) & (member_1P < per_group)
    choice_GP = jnp.where(valid_GP, scores_GP + bias_ref[...], -jnp.inf)
    if rule.n_group:
        choice_GP = jnp.where(_kept_groups(choice_GP, rule.topk_group), choice_GP, -jnp.inf)
    position_E = jnp.arange(padded_groups * padded_per_group)
    choice_E = choice_GP.reshape(-1)
    slot_S = jnp.arange(slots)
    positions_S = jnp.full((slots,), -1, jnp.int32)  # padded slots pick nothing
    for slot in range(rule.top_k):
        position = jnp.argmax(choice_E)
        positions_S = jnp.where(slot_S == slot, position.astype(jnp.int32), positions_S)
        choice_E = jnp.where(position_E == position, -jnp.inf, choice_E)
    # the picks' scores in one [slots, E] reduction after the loop, not one reduction a pick inside it
    picked_SE = position_E[None, :] == positions_S[:, None]
    weights_S = jnp.sum(jnp.where(picked_SE, scores_GP.reshape(-1)[None, :], 0.0), axis=1)
    experts_S = (positions_S // padded_per_group) * per_group + positions_S % padded_per_group
    experts_S = jnp.where(slot_S < rule.top_k, experts_S, 0)
    if rule.norm_topk_prob:
        weights_S = weights_S / (jnp.sum(weights_S) + 1e-20)
    weights_ref[...] = weights_S * rule.scaling
    experts_ref[...] = experts_S


@functools.partial(jax.jit, static_argnames=("rule", "num_warps", "interpret"))
def select_experts_gpu(
    logits_TE, expert_bias_E, rule: RoutingRule, *, num_warps: int | None = None, interpret: bool = False
):
    """`select_experts_reference` as one Pallas kernel (Triton lowering), one token a program (module docstring);
    the logits and bias go as [T, G, P] and [G, P] (a bitcast where G and P are powers of two, else padded), the
    slots up to a power of two. num_warps: None from `tuned.SELECT_EXPERTS` (one warp: the whole-row operations
    stay in its registers, 16 logits a thread at E = 512)."""
    num_warps = num_warps or lookup(tuned.SELECT_EXPERTS, dtype=logits_TE.dtype).num_warps
    tokens, num_experts = logits_TE.shape
    groups, per_group, padded_groups, padded_per_group = _group_tile(num_experts, rule)
    pads = ((0, padded_groups - groups), (0, padded_per_group - per_group))
    logits_TGP = jnp.pad(logits_TE.astype(jnp.float32).reshape(tokens, groups, per_group), ((0, 0), *pads))
    bias_GP = jnp.pad(expert_bias_E.astype(jnp.float32).reshape(groups, per_group), pads)
    slots = pl.next_power_of_2(rule.top_k)
    tile = (padded_groups, padded_per_group)
    weights_TS, experts_TS = pl.pallas_call(
        functools.partial(_kernel, rule=rule, groups=groups, per_group=per_group),
        grid=(tokens,),
        in_specs=[pl.BlockSpec((None, *tile), lambda t: (t, 0, 0)), pl.BlockSpec(tile, lambda t: (0, 0))],
        out_specs=[pl.BlockSpec((None, slots), lambda t: (t, 0))] * 2,
        out_shape=[
            jax.ShapeDtypeStruct((tokens, slots), jnp.float32),
            jax.ShapeDtypeStruct((tokens, slots), jnp.int32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="select_experts",
    )(logits_TGP, bias_GP)
    return weights_TS[:, : rule.top_k], experts_TS[:, : rule.top_k]
