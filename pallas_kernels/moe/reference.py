"""The MoE ops in pure jnp, the spec in code: the grouped matmul (the expert GEMM over rows sorted by
expert), its fused neighbours `gather_swiglu` (gate/up over rows gathered from the unsorted activations, then
SwiGLU) and `down_scatter` (down, weighted per row, stored back to each row's original place), the routed
experts of a few tokens (each token's picked experts, combined) and the router's expert selection.

Grouped matmul: rows of lhs are sorted by group: the first group_sizes[0] rows belong to group 0, the next
group_sizes[1] to group 1, and so on; each group multiplies its rows by its own weight in the checkpoint's
[out, in] layout, so out[rows of g] = lhs[rows of g] @ rhs[g].T. Rows at or past sum(group_sizes) give zeros.

Expert weights may be quantised (block FP8 or MXFP4: anything with `values`, `scales` and `dequantize(dtype)`,
`ling_jax.quantized`): the references dequantise them first (`dense_weight`), which is the weight-only kernels'
spec; the routed experts of a few tokens dequantise only the picked experts.

Expert selection, group-limited sigmoid routing (spec §4) after the router matmul. For each token: scores =
sigmoid(logits); choice = scores + expert_bias (the bias steers selection only); with groups, each group scores
the sum of its two best choices and only the `topk_group` best groups stay (ties to the lower group); then the
top_k best choices of the kept groups (ties to the lower expert), whose un-biased scores, optionally
renormalised, times the scaling factor are the weights. Group selection is written with maxima and pairwise
ranks, then `lax.top_k`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# lhs [M, K] x rhs [G, N, K] -> [M, N]: contract K with K, M is ragged over rhs's group dimension.
_RAGGED_MK_GNK = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


def dense_weight(weight, dtype) -> jax.Array:
    """A quantised weight (module docstring) dequantised to dtype; an array as it is (cast later, where used)."""
    return weight.dequantize(dtype) if hasattr(weight, "dequantize") else weight


def grouped_matmul_reference(lhs_MK, rhs_GNK, group_sizes_G) -> jax.Array:
    """out [M, N] in lhs's dtype, accumulated in fp32; differentiable in lhs and rhs.

    group_sizes int [G], traced, with sum <= M. The tail rows are zeroed explicitly: ragged_dot leaves
    them unspecified in its documentation. fp32 products are full fp32 (XLA would use tf32 on a GPU).
    On a GPU, XLA (jax 0.11.2) lowers ragged_dot through a masked copy of lhs per group, [G, M, K]: fine
    for tests, out of memory at MoE sizes (use the "pallas_gpu" backend there).
    """
    precision = jax.lax.Precision.HIGHEST if lhs_MK.dtype == jnp.float32 else None
    out_MN = jax.lax.ragged_dot_general(
        lhs_MK,
        rhs_GNK.astype(lhs_MK.dtype),
        group_sizes_G.astype(jnp.int32),
        _RAGGED_MK_GNK,
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    used_M = jnp.arange(lhs_MK.shape[0]) < jnp.sum(group_sizes_G)
    return jnp.where(used_M[:, None], out_MN, 0.0).astype(lhs_MK.dtype)


def swiglu(gate: jax.Array, up: jax.Array, limit: float | None) -> jax.Array:
    """SiLU(gate) * up, or min(SiLU(gate), limit) * clip(up, -limit, limit) when the layer has a limit."""
    activated = jax.nn.silu(gate)
    if limit is None:
        return activated * up
    return jnp.minimum(activated, limit) * jnp.clip(up, -limit, limit)


def combine(y_TKD, weights_TK, dtype) -> jax.Array:
    """sum_k weights[t, k] * y[t, k] in fp32, cast to `dtype`: each token's k expert outputs, weighted."""
    return jnp.einsum("tkd,tk->td", y_TKD.astype(jnp.float32), weights_TK.astype(jnp.float32)).astype(dtype)


def routed_experts_reference(
    x_TD,
    weights_TK,
    experts_TK,
    gate_EID,
    up_EID,
    down_EDI,
    limit: float | None,
    shared=None,
    shared_limit: float | None = None,
):
    """sum_k weights[t, k] * FFN_{experts[t, k]}(x[t]) -> [T, D] in x's dtype, where FFN_e is expert e's SwiGLU
    (clipped at `limit`), computed in fp32 from the gathered experts' weights [T, K, ...]; experts outside
    [0, E) contribute nothing. shared: None, or the shared expert's (gate [I, D], up [I, D], down [D, I]),
    clipped at `shared_limit` and added (in fp32, before the cast)."""
    num_experts = gate_EID.shape[0]
    valid_TK = (experts_TK >= 0) & (experts_TK < num_experts)
    index_TK = jnp.clip(experts_TK, 0, num_experts - 1)
    x = x_TD.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    gate_TKID, up_TKID, down_TKDI = (
        dense_weight(jax.tree.map(lambda a: a[index_TK], w), jnp.float32).astype(jnp.float32)
        for w in (gate_EID, up_EID, down_EDI)
    )  # the picked experts only (a quantised weight: its values and scales gathered, then dequantised)
    gate = jnp.einsum("td,tkid->tki", x, gate_TKID, precision=hi)
    up = jnp.einsum("td,tkid->tki", x, up_TKID, precision=hi)
    y_TKD = jnp.einsum("tki,tkdi->tkd", swiglu(gate, up, limit), down_TKDI, precision=hi)
    weights_TK = jnp.where(valid_TK, weights_TK.astype(jnp.float32), 0.0)
    y_TD = jnp.einsum("tkd,tk->td", y_TKD, weights_TK, precision=hi)
    if shared is not None:
        shared_gate_ID, shared_up_ID, shared_down_DI = (
            dense_weight(w, jnp.float32).astype(jnp.float32) for w in shared
        )
        hidden_TI = swiglu(
            jnp.dot(x, shared_gate_ID.T, precision=hi), jnp.dot(x, shared_up_ID.T, precision=hi), shared_limit
        )
        y_TD = y_TD + jnp.dot(hidden_TI, shared_down_DI.T, precision=hi)
    return y_TD.astype(x_TD.dtype)


def gather_swiglu_reference(x_XD, source_R, group_sizes_G, gate_GID, up_GID, limit: float | None):
    """h [R, I] in x's dtype: swiglu(x[source[r]] @ gate[g].T, x[source[r]] @ up[g].T, limit) for the rows r
    of group g; rows at or past sum(group_sizes) give zeros."""
    x_RD = x_XD[source_R]
    gate_GID, up_GID = (dense_weight(w, x_XD.dtype) for w in (gate_GID, up_GID))
    return swiglu(
        grouped_matmul_reference(x_RD, gate_GID, group_sizes_G),
        grouped_matmul_reference(x_RD, up_GID, group_sizes_G),
        limit,
    )


def down_scatter_reference(h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI):
    """y [R, D] in h's dtype: y[dest[r]] = row_weight[r] * (h[r] @ down[g].T) for the rows r of group g, the
    weighting in fp32; rows at or past sum(group_sizes) give zeros. dest is a permutation of [0, R)."""
    y_RD = grouped_matmul_reference(h_RI, dense_weight(down_GDI, h_RI.dtype), group_sizes_G)
    weighted_RD = (row_weight_R.astype(jnp.float32)[:, None] * y_RD.astype(jnp.float32)).astype(h_RI.dtype)
    return jnp.zeros_like(weighted_RD).at[dest_R].set(weighted_RD)


@dataclasses.dataclass(frozen=True)
class RoutingRule:
    """top_k experts per token from n_group groups of which topk_group are kept (n_group 0 or None: no
    groups); weights renormalised to sum 1 when norm_topk_prob, then multiplied by scaling."""

    top_k: int
    n_group: int | None
    topk_group: int | None
    norm_topk_prob: bool
    scaling: float


def kept_groups(choice_TGS, keep: int):
    """[T, G] bool: the `keep` groups with the largest sum of their two best scores, ties to the lower group
    (what top_k of the group scores picks). Written with maxima and pairwise ranks rather than top_k, which
    XLA runs as a sort."""
    best_TG = jnp.max(choice_TGS, axis=-1)
    first_best_TGS = jnp.arange(choice_TGS.shape[-1]) == jnp.argmax(choice_TGS, axis=-1)[..., None]
    score_TG = best_TG + jnp.max(jnp.where(first_best_TGS, -jnp.inf, choice_TGS), axis=-1)
    groups = jnp.arange(score_TG.shape[-1])
    ahead_TGH = (score_TG[:, None, :] > score_TG[:, :, None]) | (
        (score_TG[:, None, :] == score_TG[:, :, None]) & (groups[None, :] < groups[:, None])
    )
    return jnp.sum(ahead_TGH, axis=-1) < keep


def routing_weights(logits_TE, experts_TK, rule: RoutingRule):
    """[T, top_k] fp32: the picked experts' un-biased sigmoid scores, renormalised and scaled."""
    weights_TK = jnp.take_along_axis(jax.nn.sigmoid(logits_TE.astype(jnp.float32)), experts_TK, axis=1)
    if rule.norm_topk_prob:
        weights_TK = weights_TK / (weights_TK.sum(-1, keepdims=True) + 1e-20)
    return weights_TK * rule.scaling


def select_experts_reference(logits_TE, expert_bias_E, rule: RoutingRule):
    """(weights [T, top_k] fp32, experts [T, top_k] int32) from router logits [T, E] (fp32)."""
    scores_TE = jax.nn.sigmoid(logits_TE.astype(jnp.float32))
    choice_TE = scores_TE + expert_bias_E.astype(jnp.float32)
    if rule.n_group:
        num_experts = choice_TE.shape[1]
        keep_TG = kept_groups(choice_TE.reshape(choice_TE.shape[0], rule.n_group, -1), rule.topk_group)
        choice_TE = jnp.where(jnp.repeat(keep_TG, num_experts // rule.n_group, axis=1), choice_TE, -jnp.inf)
    _, experts_TK = jax.lax.top_k(choice_TE, rule.top_k)
    return routing_weights(logits_TE, experts_TK, rule), experts_TK.astype(jnp.int32)
