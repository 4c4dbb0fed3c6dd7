"""Expert selection on GPU (`select_experts_reference`'s picks, exactly, ties included, and its weights up to
fp32 rounding): one Pallas kernel (Triton lowering), program = a block of tokens holding all E logits. The whole
selection runs in registers (top_k rounds of max / lowest-index / mask), where XLA runs a sort and about eight
small fusions per layer: what a one-token decode step pays in launches.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.moe import tuned
from pallas_kernels.moe.gpu_triton.masked import mask_2d, masked_load
from pallas_kernels.moe.reference import RoutingRule
from pallas_kernels.tuning import fill, lookup


def _count(condition):
    """int32 0/1 of a boolean (Triton's lowering keeps a where of two constants as i1)."""
    return condition.astype(jnp.int32)


def _best_and_first(choice_TE, column_E, num_columns: int):
    """Per row: the largest choice and the lowest column holding it."""
    best_T = jnp.max(choice_TE, axis=1)
    first_T = jnp.min(jnp.where(choice_TE == best_T[:, None], column_E[None, :], num_columns), axis=1)
    return best_T, first_T


def _kept_columns(choice_TE, column_E, *, num_columns: int, per_group: int, n_group: int, topk_group: int):
    """[T, E] bool: the columns of each row's kept groups (`kept_groups`, unrolled over the groups)."""
    group_E = column_E // per_group
    group_scores = []
    for group in range(n_group):
        in_group_TE = jnp.where((group_E == group)[None, :], choice_TE, -jnp.inf)
        best_T, first_T = _best_and_first(in_group_TE, column_E, num_columns)
        second_T = jnp.max(jnp.where(column_E[None, :] == first_T[:, None], -jnp.inf, in_group_TE), axis=1)
        group_scores.append(best_T + second_T)
    kept_TE = jnp.zeros(choice_TE.shape, jnp.int32)
    for group, score_T in enumerate(group_scores):
        ahead_T = sum(
            _count(other_T > score_T) + (_count(other_T == score_T) if other < group else 0)
            for other, other_T in enumerate(group_scores)
            if other != group
        )
        kept_TE += _count((group_E == group)[None, :] & (ahead_T < topk_group)[:, None])
    return kept_TE > 0


def _kernel(logits_ref, bias_ref, weights_ref, experts_ref, *, rule: RoutingRule, num_experts: int, block_t: int):
    num_columns, slots = logits_ref.shape[1], weights_ref.shape[1]
    row0 = pl.program_id(0) * block_t
    rows_ok_T = row0 + jnp.arange(block_t) < logits_ref.shape[0]
    column_E = jnp.arange(num_columns)
    columns_ok_E = column_E < num_experts
    logits_TE = masked_load(logits_ref.at[pl.ds(row0, block_t), :], mask_2d(rows_ok_T, None))
    scores_TE = jax.nn.sigmoid(logits_TE)
    choice_TE = jnp.where(columns_ok_E[None, :], scores_TE + bias_ref[...][None, :], -jnp.inf)
    if rule.n_group:
        kept_TE = _kept_columns(
            choice_TE,
            column_E,
            num_columns=num_columns,
            per_group=num_experts // rule.n_group,
            n_group=rule.n_group,
            topk_group=rule.topk_group,
        )
        choice_TE = jnp.where(kept_TE, choice_TE, -jnp.inf)
    slot_S = jnp.arange(slots)
    weights_TS = jnp.zeros((block_t, slots), jnp.float32)
    experts_TS = jnp.zeros((block_t, slots), jnp.int32)
    for slot in range(rule.top_k):
        _, expert_T = _best_and_first(choice_TE, column_E, num_columns)
        picked_TE = column_E[None, :] == expert_T[:, None]
        score_T = jnp.sum(jnp.where(picked_TE, scores_TE, 0.0), axis=1)
        here_S = (slot_S == slot)[None, :]
        weights_TS = jnp.where(here_S, score_T[:, None], weights_TS)
        experts_TS = jnp.where(here_S, expert_T[:, None], experts_TS)
        choice_TE = jnp.where(picked_TE, -jnp.inf, choice_TE)
    if rule.norm_topk_prob:
        weights_TS = weights_TS / (jnp.sum(weights_TS, axis=1, keepdims=True) + 1e-20)
    out_mask = mask_2d(rows_ok_T, slot_S < rule.top_k)
    plgpu.store(weights_ref.at[pl.ds(row0, block_t), :], weights_TS * rule.scaling, mask=out_mask)
    plgpu.store(experts_ref.at[pl.ds(row0, block_t), :], experts_TS, mask=out_mask)


@functools.partial(jax.jit, static_argnames=("rule", "block_t", "num_warps", "interpret"))
def select_experts_gpu(
    logits_TE,
    expert_bias_E,
    rule: RoutingRule,
    *,
    block_t: int | None = None,
    num_warps: int | None = None,
    interpret: bool = False,
):
    """`select_experts_reference` as one Pallas kernel (Triton lowering); the padded columns (E up to a power
    of two) and slots (top_k likewise) are masked. Tiles: None from `tuned.SELECT_EXPERTS` (one token per
    single-warp program: the ~100 whole-row operations then stay in one warp's registers, 16 logits per thread at
    E = 512, where a [16, 512] block per 4 warps spilled)."""
    block_t, num_warps = fill((block_t, num_warps), lookup(tuned.SELECT_EXPERTS, dtype=logits_TE.dtype))
    tokens, num_experts = logits_TE.shape
    columns, slots = pl.next_power_of_2(num_experts), pl.next_power_of_2(rule.top_k)
    logits_TE = jnp.pad(logits_TE.astype(jnp.float32), ((0, 0), (0, columns - num_experts)))
    bias_E = jnp.pad(expert_bias_E.astype(jnp.float32), (0, columns - num_experts))
    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))  # noqa: E731
    weights_TS, experts_TS = pl.pallas_call(
        functools.partial(_kernel, rule=rule, num_experts=num_experts, block_t=block_t),
        grid=(pl.cdiv(tokens, block_t),),
        in_specs=[whole(logits_TE.shape), whole(bias_E.shape)],
        out_specs=[whole((tokens, slots)), whole((tokens, slots))],
        out_shape=[
            jax.ShapeDtypeStruct((tokens, slots), jnp.float32),
            jax.ShapeDtypeStruct((tokens, slots), jnp.int32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="select_experts",
    )(logits_TE, bias_E)
    return weights_TS[:, : rule.top_k], experts_TS[:, : rule.top_k]
