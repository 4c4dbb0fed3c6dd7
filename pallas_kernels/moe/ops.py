"""MoE ops: `grouped_matmul` (the expert GEMM over rows sorted by expert, one weight per group), its fused
neighbours `gather_swiglu` (gate/up + SwiGLU over rows gathered from the unsorted activations) and `down_scatter`
(down, weighted per row, stored to each row's original place), `routed_experts` (a few tokens' picked experts,
row by row, combined) and `select_experts` (the router's group-limited expert selection), each over its variants.

VARIANTS lists every implementation by op and name; `kernel(op, name)` gives one's entry point (with its
block-size overrides, for tests and benchmarks). Without a variant named, a GPU backend runs "gpu_triton", a TPU
backend runs "tpu_mosaic" for a grouped matmul with a quantised (block-FP8 or MXFP4) weight stack, and every other
case the jnp reference. Expert weights may be quantised (`ling_jax.quantized`): on a GPU, by default
`gather_swiglu` and `down_scatter` then run the weight-only kernels WEIGHT_ONLY (each tile dequantised on chip,
nothing dense written: a decode step with more than a few rows reads the touched experts' stored bytes instead of
dequantising the whole layer, and a prefill chunk needs no bf16 copy of the layer's experts); named "gpu_triton"
they dequantise the layer to the activation dtype inside the step and run the dense kernels. `routed_experts`
runs WEIGHT_ONLY for block-FP8 experts and dequantises only the picked experts for MXFP4 ones (their weight-only
row kernels were the slower; `_pick_rows`); elsewhere the dequantise-then-reference path.

The routed experts as a whole: `expert_path` is the one place that chooses which of these kernels run them (by the
backend, the rows of the call, the experts' format and the FP8 mode; thresholds in `tuned`), as an `ExpertPath`;
`moe_experts` runs a token batch's experts on it (`ExpertWeights`, `Routing`), `grouped_expert_ffn` and
`expert_sorted_ffn` run rows with an expert each (expert parallelism's received rows).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import variants
from pallas_kernels.backend import KERNEL_TARGET, FP8Matmul, resolve_backend, with_reference_vjp
from pallas_kernels.moe import tuned
from pallas_kernels.moe.gpu_triton import (
    down_scatter_gpu,
    down_scatter_weight_only_gpu,
    gather_swiglu_gpu,
    gather_swiglu_weight_only_gpu,
    grouped_matmul_gpu,
    grouped_weight_grad_gpu,
    routed_experts_gpu,
    routed_experts_weight_only_gpu,
    select_experts_gpu,
)
from pallas_kernels.moe.gpu_triton.w8a8 import takes_block
from pallas_kernels.moe.gpu_triton.w8a8 import w8a8_expert_rows as w8a8_expert_rows_gpu
from pallas_kernels.moe.reference import (
    RoutingRule,
    combine,
    dense_weight,
    down_scatter_reference,
    gather_swiglu_reference,
    grouped_matmul_reference,
    routed_experts_reference,
    routing_weights,
    select_experts_reference,
    swiglu,
)
from pallas_kernels.moe.tpu_mosaic import grouped_matmul_tpu, grouped_matmul_tpu_op
from pallas_kernels.moe.w8a8_reference import w8a8_expert_rows_reference
from pallas_kernels.tpu_dequant import as_dense, is_quantized
from pallas_kernels.variants import REFERENCE, Variant

__all__ = [
    "VARIANTS",
    "WEIGHT_ONLY",
    "ExpertKernel",
    "ExpertPath",
    "ExpertWeights",
    "Routing",
    "RoutingRule",
    "down_scatter",
    "expert_path",
    "expert_sorted_ffn",
    "gather_swiglu",
    "grouped_expert_ffn",
    "grouped_matmul",
    "kernel",
    "moe_experts",
    "routed_experts",
    "select_experts",
    "sort_by_expert",
    "w8a8_expert_rows",
    "w8a8_takes",
]

WEIGHT_ONLY = "gpu_triton_weight_only"  # the fused and row kernels with quantised experts

VARIANTS = {
    "grouped_matmul": {
        REFERENCE: Variant(None, grouped_matmul_reference),
        "gpu_triton": Variant("gpu", grouped_matmul_gpu),
        "tpu_mosaic": Variant("tpu", grouped_matmul_tpu),
    },
    "gather_swiglu": {
        REFERENCE: Variant(None, gather_swiglu_reference),
        "gpu_triton": Variant("gpu", gather_swiglu_gpu),
        WEIGHT_ONLY: Variant("gpu", gather_swiglu_weight_only_gpu),
    },
    "down_scatter": {
        REFERENCE: Variant(None, down_scatter_reference),
        "gpu_triton": Variant("gpu", down_scatter_gpu),
        WEIGHT_ONLY: Variant("gpu", down_scatter_weight_only_gpu),
    },
    "routed_experts": {
        REFERENCE: Variant(None, routed_experts_reference),
        "gpu_triton": Variant("gpu", routed_experts_gpu),
        WEIGHT_ONLY: Variant("gpu", routed_experts_weight_only_gpu),
    },
    "w8a8_expert_rows": {
        REFERENCE: Variant(None, w8a8_expert_rows_reference),
        "gpu_triton": Variant("gpu", w8a8_expert_rows_gpu),
    },
    "select_experts": {
        REFERENCE: Variant(None, select_experts_reference),
        "gpu_triton": Variant("gpu", select_experts_gpu),
    },
}


def kernel(op: str, name: str):
    """The entry point of variant `name` of `op` (a key of VARIANTS)."""
    return variants.lookup(VARIANTS, op, name).kernel


def _pick(op: str, variant: str | None, backend: str, tpu: str = REFERENCE) -> tuple[str, bool]:
    """(variant name, interpret): "gpu_triton" on a GPU backend, `tpu` on a TPU backend, the reference elsewhere,
    unless one is named."""
    backend = resolve_backend(backend)
    default = variants.by_platform(backend, {"gpu": "gpu_triton", "tpu": tpu})
    return variants.pick(VARIANTS, op, variant, backend, default), variants.interpreted(backend)


def _pick_fused(op: str, variant: str | None, backend: str, weights) -> tuple[str, bool]:
    """`_pick` for the fused kernels: unnamed, quantised weights on a GPU backend run WEIGHT_ONLY."""
    name, interpret = _pick(op, variant, backend)
    if variant is None and name == "gpu_triton" and any(is_quantized(w) for w in weights):
        return WEIGHT_ONLY, interpret
    return name, interpret


def _pick_rows(variant: str | None, backend: str, weights) -> tuple[str, bool]:
    """`_pick` for `routed_experts`: unnamed, block-FP8 routed experts on a GPU backend run WEIGHT_ONLY (the
    shared expert, in any format, rides along), MXFP4 ones too where tuned.ROWS_WEIGHT_ONLY_MXFP4 says so."""
    name, interpret = _pick("routed_experts", variant, backend)
    quantized = [w for w in weights if is_quantized(w)]
    read_as_stored = all(getattr(w, "block", None) or tuned.ROWS_WEIGHT_ONLY_MXFP4 for w in quantized)
    if variant is None and name == "gpu_triton" and quantized and read_as_stored:
        return WEIGHT_ONLY, interpret
    return name, interpret


def _dense(weights, dtype) -> tuple:
    """Expert weights for the dense kernels: quantised ones dequantised to dtype, inside the step (one layer's
    experts, or this device's under expert parallelism), arrays as they are."""
    return tuple(dense_weight(w, dtype) for w in weights)


def _picked_dense(experts_TK, stacks, dtype):
    """(experts [T, k], stacks) for the dense row kernels: with a quantised stack among them, each slot's expert
    gathered (values and scales) and dequantised to dtype, [T * k, ...] stacks that slot (t, k) reads at row
    t * k + k (an invalid slot stays invalid), so a decode step dequantises T * k experts, not E."""
    if not any(is_quantized(w) for w in stacks):
        return experts_TK, stacks
    num_experts = stacks[0].shape[0]
    valid_TK = (experts_TK >= 0) & (experts_TK < num_experts)
    index_S = jnp.clip(experts_TK, 0, num_experts - 1).reshape(-1)
    picked = tuple(dense_weight(jax.tree.map(lambda a: a[index_S], w), dtype) for w in stacks)
    slots_TK = jnp.arange(index_S.shape[0], dtype=jnp.int32).reshape(experts_TK.shape)
    return jnp.where(valid_TK, slots_TK, -1), picked


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gpu_kernel(lhs_MK, rhs_GNK, group_sizes_G, interpret: bool):
    return grouped_matmul_gpu(lhs_MK, rhs_GNK, group_sizes_G, interpret=interpret)


def _gpu_kernel_fwd(lhs_MK, rhs_GNK, group_sizes_G, interpret):
    return _gpu_kernel(lhs_MK, rhs_GNK, group_sizes_G, interpret), (lhs_MK, rhs_GNK, group_sizes_G)


def _gpu_kernel_bwd(interpret, residuals, d_out_MN):
    lhs_MK, rhs_GNK, group_sizes_G = residuals
    d_lhs_MK = grouped_matmul_gpu(d_out_MN, rhs_GNK, group_sizes_G, rhs_transposed=True, interpret=interpret)
    d_rhs_GNK = grouped_weight_grad_gpu(lhs_MK, d_out_MN, group_sizes_G, interpret=interpret)
    return d_lhs_MK, d_rhs_GNK.astype(rhs_GNK.dtype), None


_gpu_kernel.defvjp(_gpu_kernel_fwd, _gpu_kernel_bwd)


def grouped_matmul(lhs_MK, rhs_GNK, group_sizes_G, *, backend: str = "auto", variant: str | None = None) -> jax.Array:
    """out [M, N] in lhs's dtype (fp32 accumulation): out[rows of g] = lhs[rows of g] @ rhs[g].T.

    lhs [M, K] rows sorted by group (the first group_sizes[0] rows are group 0, ...); rhs [G, N, K] in the
    checkpoint's [out, in] layout: an array, or on a TPU backend (and the reference) a quantised stack
    (`ling_jax.quantized.BlockFP8Weight` / `MXFP4Weight`); group_sizes int32 [G], traced, sum <= M; rows past
    the sum give zeros. backend: "auto" (the GPU kernel on a GPU, the jnp reference elsewhere), "reference" (jnp
    ragged dot, a quantised rhs dequantised first), "pallas_gpu", or "interpret_gpu" (the GPU kernel in Pallas
    interpret mode, for CPU tests); "pallas_tpu", "interpret_tpu", "interpret" (and "auto" on a TPU) run the
    "tpu_mosaic" kernel for a quantised rhs (dequantised in VMEM) and XLA's ragged dot for a dense one.
    Differentiable in lhs and rhs with every backend; the GPU backends take their gradients from the GPU
    kernels too (XLA's GPU ragged_dot materialises a masked lhs per group: out of memory at MoE sizes).
    """
    tpu = "tpu_mosaic" if is_quantized(rhs_GNK) else REFERENCE
    name, interpret = _pick("grouped_matmul", variant, backend, tpu=tpu)
    if name == "tpu_mosaic":
        return grouped_matmul_tpu_op(lhs_MK, rhs_GNK, group_sizes_G, interpret)
    if name == "gpu_triton":
        return _gpu_kernel(lhs_MK, rhs_GNK, group_sizes_G, interpret)
    return grouped_matmul_reference(lhs_MK, as_dense(rhs_GNK, lhs_MK.dtype), group_sizes_G)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _gather_swiglu_gpu(x_XD, source_R, group_sizes_G, gate_GID, up_GID, limit, fill_tail, interpret):
    return gather_swiglu_gpu(
        x_XD, source_R, group_sizes_G, gate_GID, up_GID, limit=limit, fill_tail=fill_tail, interpret=interpret
    )


def _gather_swiglu_gpu_fwd(x_XD, source_R, group_sizes_G, gate_GID, up_GID, limit, fill_tail, interpret):
    h_RI = _gather_swiglu_gpu(x_XD, source_R, group_sizes_G, gate_GID, up_GID, limit, fill_tail, interpret)
    return h_RI, (x_XD, source_R, group_sizes_G, gate_GID, up_GID)


def _gather_swiglu_gpu_bwd(limit, fill_tail, interpret, residuals, d_h_RI):
    """Recomputes the gate and up products from a materialised x[source] (nothing [R, I] is kept from the
    forward pass), then the plain grouped-matmul kernels: d_x rows through the transposed weights, summed
    back onto x's rows (a token's repeats add up), and the weight-grad kernel for gate and up."""
    del fill_tail  # the tail's cotangent rows meet no expert: they add nothing
    x_XD, source_R, group_sizes_G, gate_GID, up_GID = residuals
    dtype = x_XD.dtype
    x_RD = x_XD[source_R]
    gate_RI, up_RI = (
        grouped_matmul_gpu(x_RD, w.astype(dtype), group_sizes_G, interpret=interpret) for w in (gate_GID, up_GID)
    )
    _, swiglu_vjp = jax.vjp(lambda g, u: swiglu(g, u, limit), gate_RI.astype(jnp.float32), up_RI.astype(jnp.float32))
    d_gate_RI, d_up_RI = (d.astype(dtype) for d in swiglu_vjp(d_h_RI.astype(jnp.float32)))
    d_x_RD = sum(
        grouped_matmul_gpu(d, w.astype(dtype), group_sizes_G, rhs_transposed=True, interpret=interpret).astype(
            jnp.float32
        )
        for d, w in ((d_gate_RI, gate_GID), (d_up_RI, up_GID))
    )
    d_x_XD = jnp.zeros(x_XD.shape, jnp.float32).at[source_R].add(d_x_RD).astype(dtype)
    d_gate_GID, d_up_GID = (
        grouped_weight_grad_gpu(x_RD, d, group_sizes_G, interpret=interpret).astype(w.dtype)
        for d, w in ((d_gate_RI, gate_GID), (d_up_RI, up_GID))
    )
    return d_x_XD, None, None, d_gate_GID, d_up_GID


_gather_swiglu_gpu.defvjp(_gather_swiglu_gpu_fwd, _gather_swiglu_gpu_bwd)


_gather_swiglu_weight_only = with_reference_vjp(
    lambda x, source, sizes, gate, up, limit, fill_tail, interpret: gather_swiglu_weight_only_gpu(
        x, source, sizes, gate, up, limit=limit, fill_tail=fill_tail, interpret=interpret
    ),
    lambda x, source, sizes, gate, up, limit, fill_tail, interpret: gather_swiglu_reference(
        x, source, sizes, gate, up, limit
    ),
    nondiff_argnums=(5, 6, 7),
)


def gather_swiglu(
    x_XD,
    source_R,
    group_sizes_G,
    gate_GID,
    up_GID,
    limit: float | None,
    *,
    backend: str = "auto",
    variant: str | None = None,
    fill_tail: bool = True,
) -> jax.Array:
    """h [R, I] in x's dtype: h[r] = swiglu(x[source[r]] @ gate[g].T, x[source[r]] @ up[g].T, limit) for the
    rows r of group g: the rows sorted by group (group_sizes int32 [G], traced, sum <= R), each read from x's
    row source[r] (int32 [R], repeats allowed); rows past the sum give zeros, or with fill_tail False are
    undefined (the GPU kernel skips them; other backends still give zeros). gate, up [G, I, D]: arrays, or
    quantised weights (block FP8, MXFP4: the module docstring).

    backend as for `grouped_matmul`: the GPU backends run one fused kernel (the rows gathered inside it, both
    products and the SwiGLU in fp32 before the one store; quantised weights read as stored by WEIGHT_ONLY, or
    dequantised first by a named "gpu_triton"); the others the jnp reference. Differentiable in x, gate and up;
    the GPU backward pass recomputes the products with the grouped-matmul kernels (WEIGHT_ONLY: as
    dequantise-then-reference).
    """
    name, interpret = _pick_fused("gather_swiglu", variant, backend, (gate_GID, up_GID))
    if name == "gpu_triton":
        gate_GID, up_GID = _dense((gate_GID, up_GID), x_XD.dtype)
        return _gather_swiglu_gpu(x_XD, source_R, group_sizes_G, gate_GID, up_GID, limit, fill_tail, interpret)
    if name == WEIGHT_ONLY:
        return _gather_swiglu_weight_only(x_XD, source_R, group_sizes_G, gate_GID, up_GID, limit, fill_tail, interpret)
    return gather_swiglu_reference(x_XD, source_R, group_sizes_G, gate_GID, up_GID, limit)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _down_scatter_gpu(h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI, fill_tail, interpret):
    return down_scatter_gpu(
        h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI, fill_tail=fill_tail, interpret=interpret
    )


def _down_scatter_gpu_fwd(h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI, fill_tail, interpret):
    y_RD = _down_scatter_gpu(h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI, fill_tail, interpret)
    return y_RD, (h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI)


def _down_scatter_gpu_bwd(fill_tail, interpret, residuals, d_y_RD):
    """The plain grouped-matmul kernels on d_y gathered into sorted order: one transposed product gives the
    unweighted d_h, hence d_h (times the row weight) and d_row_weight (its dot with h); the weight-grad kernel
    gives d_down from the weighted h."""
    del fill_tail  # the tail rows meet no expert: zero cotangents for h and the row weights there
    h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI = residuals
    dtype = h_RI.dtype
    d_y_sorted_RD = d_y_RD[dest_R]
    d_product_RI = grouped_matmul_gpu(
        d_y_sorted_RD, down_GDI.astype(dtype), group_sizes_G, rhs_transposed=True, interpret=interpret
    ).astype(jnp.float32)
    row_weight_R1 = row_weight_R.astype(jnp.float32)[:, None]
    d_h_RI = (row_weight_R1 * d_product_RI).astype(dtype)
    d_row_weight_R = jnp.sum(d_product_RI * h_RI.astype(jnp.float32), axis=1).astype(row_weight_R.dtype)
    weighted_h_RI = (row_weight_R1 * h_RI.astype(jnp.float32)).astype(dtype)
    d_down_GDI = grouped_weight_grad_gpu(weighted_h_RI, d_y_sorted_RD, group_sizes_G, interpret=interpret)
    return d_h_RI, None, d_row_weight_R, None, d_down_GDI.astype(down_GDI.dtype)


_down_scatter_gpu.defvjp(_down_scatter_gpu_fwd, _down_scatter_gpu_bwd)


_down_scatter_weight_only = with_reference_vjp(
    lambda h, dest, row_weight, sizes, down, fill_tail, interpret: down_scatter_weight_only_gpu(
        h, dest, row_weight, sizes, down, fill_tail=fill_tail, interpret=interpret
    ),
    lambda h, dest, row_weight, sizes, down, fill_tail, interpret: down_scatter_reference(
        h, dest, row_weight, sizes, down
    ),
    nondiff_argnums=(5, 6),
)


def down_scatter(
    h_RI,
    dest_R,
    row_weight_R,
    group_sizes_G,
    down_GDI,
    *,
    backend: str = "auto",
    variant: str | None = None,
    fill_tail: bool = True,
) -> jax.Array:
    """y [R, D] in h's dtype: y[dest[r]] = row_weight[r] * (h[r] @ down[g].T) for the rows r of group g: h's
    rows sorted by group (group_sizes int32 [G], traced, sum <= R), each stored back to its original row
    dest[r] (int32 [R], a permutation of [0, R)); row_weight fp32 [R], applied to the fp32 accumulator; rows
    past the sum store zeros, or with fill_tail False leave their dest rows undefined (GPU kernel; other
    backends still store zeros). down [G, D, I]: an array or a quantised weight.

    backend as for `grouped_matmul`: the GPU backends run one kernel (scattered stores, no unsort pass;
    quantised weights as for `gather_swiglu`); the others the jnp reference. Differentiable in h, row_weight and
    down; the GPU backward pass uses the grouped-matmul kernels (WEIGHT_ONLY: as dequantise-then-reference).
    """
    name, interpret = _pick_fused("down_scatter", variant, backend, (down_GDI,))
    if name == "gpu_triton":
        (down_GDI,) = _dense((down_GDI,), h_RI.dtype)
        return _down_scatter_gpu(h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI, fill_tail, interpret)
    if name == WEIGHT_ONLY:
        return _down_scatter_weight_only(h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI, fill_tail, interpret)
    return down_scatter_reference(h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI)


def _routed_entry(entry):
    return lambda x, weights, experts, gate, up, down, shared, limit, shared_limit, interpret: entry(
        x, weights, experts, gate, up, down, shared, limit=limit, shared_limit=shared_limit, interpret=interpret
    )


def _routed_reference(x, weights, experts, gate, up, down, shared, limit, shared_limit, interpret):
    return routed_experts_reference(x, weights, experts, gate, up, down, limit, shared, shared_limit)


_ROUTED_GPU_ENTRIES = {"gpu_triton": routed_experts_gpu, WEIGHT_ONLY: routed_experts_weight_only_gpu}
# {variant: the GPU kernels}, differentiated as the reference (a quantised weight: dequantise-then-reference)
_ROUTED_GPU_KERNELS = {
    name: with_reference_vjp(_routed_entry(entry), _routed_reference, nondiff_argnums=(7, 8, 9))
    for name, entry in _ROUTED_GPU_ENTRIES.items()
}


def routed_experts(
    x_TD,
    weights_TK,
    experts_TK,
    gate_EID,
    up_EID,
    down_EDI,
    limit: float | None,
    *,
    shared=None,
    shared_limit: float | None = None,
    backend: str = "auto",
    variant: str | None = None,
    split_sums: bool = False,
) -> jax.Array:
    """sum_k weights[t, k] * FFN_{experts[t, k]}(x[t]) -> [T, D] in x's dtype (fp32 accumulation); FFN_e is
    expert e's SwiGLU, min(SiLU(x W_gate), limit) * clip(x W_up, +-limit) W_down with a limit. Weights
    [E, I, D] (gate, up) and [E, D, I] (down) in the checkpoint's [out, in] layout; experts outside [0, E)
    contribute nothing. shared: None, or the MoE's shared expert (gate [I, D], up [I, D], down [D, I], the
    routed experts' width), clipped at `shared_limit` and added with weight 1. Any of them may be a quantised
    weight (block FP8, MXFP4: the module docstring), the shared expert's in a format of its own.

    For a few tokens (decode): the GPU kernels read each row's expert directly, with no sorting, and cost a
    weight read per token-expert pair (block-FP8 experts: each tile read as stored, WEIGHT_ONLY; MXFP4 ones:
    only the picked ones dequantised first, unless WEIGHT_ONLY is named); the shared expert is one more row per
    token. backend: "auto"
    (the GPU kernels on a GPU, the reference elsewhere), "reference", "pallas_gpu", "interpret_gpu"; TPU names
    run the reference. Differentiable (the backward pass is the reference's), except with split_sums: the sum as
    partial sums [S, T, D] that add up to it in split order (the GPU kernels' splits of the down product's
    width, `tuned.RowTiles.splits`; one split, the sum itself, elsewhere), for the norm after the layer to add.
    """
    shared = None if shared is None else tuple(shared)
    name, interpret = _pick_rows(variant, backend, (gate_EID, up_EID, down_EDI))
    if name == "gpu_triton":
        experts_TK, (gate_EID, up_EID, down_EDI) = _picked_dense(experts_TK, (gate_EID, up_EID, down_EDI), x_TD.dtype)
        shared = None if shared is None else _dense(shared, x_TD.dtype)
    arrays = (x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, shared)
    if name in _ROUTED_GPU_KERNELS and split_sums:
        entry = _ROUTED_GPU_ENTRIES[name]
        return entry(*arrays, limit=limit, shared_limit=shared_limit, interpret=interpret, split_sums=True)
    if name in _ROUTED_GPU_KERNELS:
        return _ROUTED_GPU_KERNELS[name](*arrays, limit, shared_limit, interpret)
    y_TD = routed_experts_reference(*arrays[:6], limit, shared, shared_limit)
    return y_TD[None] if split_sums else y_TD


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _select_experts_gpu(logits_TE, expert_bias_E, rule: RoutingRule, interpret: bool):
    return select_experts_gpu(logits_TE, expert_bias_E, rule, interpret=interpret)


def _select_experts_gpu_fwd(logits_TE, expert_bias_E, rule, interpret):
    weights_TK, experts_TK = select_experts_gpu(logits_TE, expert_bias_E, rule, interpret=interpret)
    return (weights_TK, experts_TK), (logits_TE, experts_TK, expert_bias_E)


def _select_experts_gpu_bwd(rule, interpret, residuals, cotangents):
    """The picks are piecewise constant: the logits' gradient is that of `routing_weights` at the picks; the
    bias only steers the picks, so its gradient is zero (as through the reference's top_k)."""
    logits_TE, experts_TK, expert_bias_E = residuals
    _, pullback = jax.vjp(lambda logits: routing_weights(logits, experts_TK, rule), logits_TE)
    return pullback(cotangents[0])[0], jnp.zeros_like(expert_bias_E)


_select_experts_gpu.defvjp(_select_experts_gpu_fwd, _select_experts_gpu_bwd)


def select_experts(logits_TE, expert_bias_E, rule: RoutingRule, *, backend: str = "auto", variant: str | None = None):
    """(weights [T, top_k] fp32, experts [T, top_k] int32) from router logits [T, E].

    backend: "auto" (the GPU kernel on a GPU, the jnp reference elsewhere), "reference", "pallas_gpu",
    "interpret_gpu" (the GPU kernel in Pallas interpret mode); TPU backends run the reference.
    Differentiable in the logits through the weights (the picks are piecewise constant), with every backend.
    """
    name, interpret = _pick("select_experts", variant, backend)
    if name == "gpu_triton":
        return _select_experts_gpu(logits_TE, expert_bias_E, rule, interpret)
    return select_experts_reference(logits_TE, expert_bias_E, rule)


def w8a8_takes(gate, up, down) -> bool:
    """Whether `w8a8_expert_rows` runs these experts: block-FP8 stacks (values, scales, block) sharing one block
    the kernels take (`gpu_triton.w8a8.takes_block`)."""
    blocks = {tuple(getattr(w, "block", None) or ()) for w in (gate, up, down)}
    if len(blocks) != 1 or not all(hasattr(w, "values") for w in (gate, up, down)):
        return False
    (block,) = blocks
    return len(block) == 2 and takes_block(block)


def _straight_through_rows(x, source, order, row_weight, sizes, gate, up, down, limit, fill_tail, interpret):
    """The weight-only rows (the experts dequantised, products in fp32): W8A8's gradient, straight through its
    quantisation."""
    h = gather_swiglu_reference(x, source, sizes, gate, up, limit)
    return down_scatter_reference(h, order, row_weight, sizes, down)


@functools.cache
def _w8a8_rows_op(entry):
    """`kernel` (a W8A8 rows entry point) with the straight-through gradient (one per entry point, made when first
    run: a lab variant registers its entry point when imported, `pallas_kernels.experimental`)."""
    return with_reference_vjp(
        lambda x, source, order, row_weight, sizes, gate, up, down, limit, fill_tail, interpret: entry(
            x, source, order, row_weight, sizes, gate, up, down, limit, fill_tail=fill_tail, interpret=interpret
        ),
        _straight_through_rows,
        nondiff_argnums=(8, 9, 10),
    )


def w8a8_expert_rows(
    x_XD,
    source_R,
    order_R,
    row_weight_R,
    sizes_E,
    gate,
    up,
    down,
    limit: float | None,
    *,
    backend: str = "auto",
    variant: str | None = None,
    fill_tail: bool = True,
) -> jax.Array:
    """[R, D] in x's dtype: the routed experts' rows in W8A8 (issue 25's prefill form), as
    `gather_swiglu` then `down_scatter` compute them (row order[r] = row_weight[r] * FFN_g(x[source[r]]) for the
    r-th row of the expert order, rows past sum(sizes) 0), with x and h quantised per token in 1 x block[1] groups
    (scale = amax / 448, e4m3) and FP8 x FP8 products scaled per K block (`gpu_triton.w8a8`; the lab variant
    "gpu_mosaic": Mosaic GPU kernels, 128 x 128 blocks, registered by `pallas_kernels.experimental.moe_gpu_mosaic`).
    gate, up [G, I, D] and down [G, D, I]: block-FP8 stacks with one block (`w8a8_takes`). backend: "auto" (the
    kernels on a GPU, the jnp reference `w8a8_reference` elsewhere), "reference", "pallas_gpu", "interpret_gpu"; TPU
    names run the reference. Differentiable in x, the row weights and the experts, straight through the
    quantisation (the gradient of the weight-only rows)."""
    if not w8a8_takes(gate, up, down):
        raise ValueError(
            "w8a8_expert_rows: gate, up and down must be block-FP8 stacks with one block whose K side is a power of "
            f"two >= 32 dividing the row side, got blocks {[getattr(w, 'block', None) for w in (gate, up, down)]}"
        )
    name, interpret = _pick("w8a8_expert_rows", variant, backend)
    return _w8a8_rows_op(kernel("w8a8_expert_rows", name))(
        x_XD, source_R, order_R, row_weight_R, sizes_E, gate, up, down, limit, fill_tail, interpret
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """The routed experts' SwiGLU stacks in the checkpoint's [out, in] layout, one slice per expert: gate and up
    [E, I, D], down [E, D, I]; arrays or quantised stacks (block FP8, MXFP4: the module docstring)."""

    gate_EID: Any
    up_EID: Any
    down_EDI: Any

    @property
    def stacks(self) -> tuple:
        return self.gate_EID, self.up_EID, self.down_EDI

    @property
    def num_experts(self) -> int:
        return self.gate_EID.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """Each token's picked experts: routing weights [T, k] fp32 and expert ids [T, k] int32; an id outside
    [0, E) contributes nothing."""

    weights_TK: jax.Array
    experts_TK: jax.Array


class ExpertKernel(enum.StrEnum):
    """Which kernels run the routed experts (`expert_path`)."""

    ROWS = "rows"  # `routed_experts`: each token-expert row streams its expert, no sort (decode on a GPU)
    FUSED = "fused"  # `gather_swiglu` then `down_scatter` over the rows in expert order (a GPU)
    W8A8 = "w8a8"  # `w8a8_expert_rows` (the kernels on a GPU, the jnp reference elsewhere)
    GROUPED = "grouped"  # the rows sorted by expert (a copy), three `grouped_matmul`s, the rows put back in order


@dataclasses.dataclass(frozen=True)
class ExpertPath:
    """How the routed experts run: the kernels, on the resolved `backend`; with_shared: the row kernels run the
    shared expert too (one more row per token)."""

    kernel: ExpertKernel
    backend: str
    with_shared: bool = False


def expert_path(
    backend: str,
    experts: ExpertWeights,
    fp8_matmul: FP8Matmul = FP8Matmul.AUTO,
    *,
    rows: int | None = None,
    shared=None,
    sorted_rows: bool = False,
) -> ExpertPath:
    """The one place that chooses the routed experts' kernels, for a call of `rows` token-expert rows (None: a
    call that never runs row by row, expert parallelism's received rows):

    - W8A8 when fp8_matmul is W8A8 and the experts are block-FP8 stacks its kernels take (`w8a8_takes`), on every
      backend, so that a token's output does not depend on how many rows share its call (the row kernels have no
      W8A8 form); rows already in expert order (`sorted_rows`: the ragged exchange's receive buffer) take it on a
      GPU backend only, elsewhere GROUPED. Under AUTO on a GPU backend, W8A8 for a prefill-sized call (`rows`
      past the row path's and in tuned.rows_bucket's "many_rows": more than FEW_ROWS_PER_GROUP rows an expert;
      8192 tokens of the Ling-3.1-flash experts: 5.3-5.7 ms against 9.1-10.5 ms weight-only on an H200,
      c8f2c21). WEIGHT_ONLY, and
      AUTO elsewhere, stay weight-only (the dequantised experts' numerics, as the transformers reference computes
      them);
    - else on a GPU backend ROWS up to tuned.ROW_PATH_MAX_ROWS rows, with the shared expert (gate, up, down)
      inside when it has the routed experts' width, and FUSED above;
    - else GROUPED.
    """
    backend = resolve_backend(backend)
    gpu = KERNEL_TARGET.get(backend) == "gpu"
    mode = FP8Matmul(fp8_matmul)
    prefill_sized = (
        rows is not None
        and rows > tuned.ROW_PATH_MAX_ROWS
        and tuned.rows_bucket(rows, experts.gate_EID.shape[0]) == "many_rows"
    )
    w8a8 = (mode is FP8Matmul.W8A8 and (gpu or not sorted_rows)) or (mode is FP8Matmul.AUTO and gpu and prefill_sized)
    if w8a8 and w8a8_takes(*experts.stacks):
        return ExpertPath(ExpertKernel.W8A8, backend)
    if not gpu:
        return ExpertPath(ExpertKernel.GROUPED, backend)
    if rows is not None and rows <= tuned.ROW_PATH_MAX_ROWS:
        with_shared = shared is not None and shared[0].shape == experts.gate_EID.shape[1:]
        return ExpertPath(ExpertKernel.ROWS, backend, with_shared)
    return ExpertPath(ExpertKernel.FUSED, backend)


def sort_by_expert(expert_R, num_experts: int):
    """(order [R]: row indices sorted by expert, stable; sizes [E] int32: rows per expert). Rows whose expert
    is outside [0, E) sort last and count in no group."""
    key_R = jnp.where((expert_R >= 0) & (expert_R < num_experts), expert_R, num_experts)
    order_R = jnp.argsort(key_R, stable=True)
    sizes_E = jnp.zeros((num_experts + 1,), jnp.int32).at[key_R].add(1)[:num_experts]
    return order_R, sizes_E


def _expert_rows(x_XD, source_R, order_R, row_weight_R, sizes_E, experts, limit, path: ExpertPath, fill_tail=True):
    """[R, D] in x's dtype: row order[r] of the result = row_weight[r] * FFN_g(x[source[r]]) for the r-th row of
    the expert order (group g); rows past sum(sizes) are 0, or undefined with fill_tail False (not computed).
    FUSED: `gather_swiglu` then `down_scatter` (quantised experts read as stored); W8A8: `w8a8_expert_rows`."""
    if path.kernel is ExpertKernel.W8A8:
        return w8a8_expert_rows(
            x_XD,
            source_R,
            order_R,
            row_weight_R,
            sizes_E,
            *experts.stacks,
            limit,
            backend=path.backend,
            fill_tail=fill_tail,
        )
    fused = {"backend": path.backend, "fill_tail": fill_tail}
    h_RI = gather_swiglu(x_XD, source_R, sizes_E, experts.gate_EID, experts.up_EID, limit, **fused)
    return down_scatter(h_RI, order_R, row_weight_R, sizes_E, experts.down_EDI, **fused)


def _three_grouped_matmuls(x_RD, sizes_E, experts: ExpertWeights, limit, backend: str):
    """GROUPED on rows in expert order. Quantised stacks go to `grouped_matmul` as stored (the TPU kernel
    dequantises each tile in VMEM, the reference one layer inside the step); the GPU grouped-matmul kernel takes
    dense weights."""
    gate_EID, up_EID, down_EDI = experts.stacks
    if KERNEL_TARGET.get(backend) == "gpu":
        gate_EID, up_EID, down_EDI = (as_dense(w, x_RD.dtype) for w in experts.stacks)
    hidden_RI = swiglu(
        grouped_matmul(x_RD, gate_EID, sizes_E, backend=backend),
        grouped_matmul(x_RD, up_EID, sizes_E, backend=backend),
        limit,
    )
    return grouped_matmul(hidden_RI, down_EDI, sizes_E, backend=backend)


def grouped_expert_ffn(x_RD, expert_R, experts: ExpertWeights, limit: float | None, path: ExpertPath) -> jax.Array:
    """[R, D] in x's dtype: row r through expert expert_R[r] (unweighted), on `path`'s kernels (not ROWS). Rows
    whose expert is outside [0, E) give 0: expert parallelism marks rows routed to other devices, or unused
    buffer slots, that way."""
    order_R, sizes_E = sort_by_expert(expert_R, experts.num_experts)
    if path.kernel is ExpertKernel.GROUPED:
        y_sorted = _three_grouped_matmuls(x_RD[order_R], sizes_E, experts, limit, path.backend)
        return jnp.zeros_like(y_sorted).at[order_R].set(y_sorted)
    return _expert_rows(x_RD, order_R, order_R, jnp.ones(order_R.shape, jnp.float32), sizes_E, experts, limit, path)


def expert_sorted_ffn(x_RD, sizes_E, experts: ExpertWeights, limit: float | None, path: ExpertPath) -> jax.Array:
    """[R, D] in x's dtype: rows already in expert order, [sum(sizes[:e]), sum(sizes[:e + 1])) through expert e;
    rows past sum(sizes) are undefined: FUSED and W8A8 neither compute nor write them (identity permutations, no
    copy; a dropless receive buffer is mostly such rows), GROUPED gives zeros there."""
    if path.kernel is ExpertKernel.GROUPED:
        return _three_grouped_matmuls(x_RD, sizes_E, experts, limit, path.backend)
    identity_R = jnp.arange(x_RD.shape[0], dtype=jnp.int32)
    ones_R = jnp.ones(identity_R.shape, jnp.float32)
    return _expert_rows(x_RD, identity_R, identity_R, ones_R, sizes_E, experts, limit, path, fill_tail=False)


def moe_experts(
    x_TD,
    routing: Routing,
    experts: ExpertWeights,
    limit: float | None,
    path: ExpertPath,
    *,
    shared=None,
    shared_limit: float | None = None,
    split_sums: bool = False,
) -> jax.Array:
    """sum_k weights[t, k] * FFN_{experts[t, k]}(x[t]) -> [T, D] in x's dtype, on the kernels `path` names
    (`expert_path`), plus the shared expert (gate [I, D], up [I, D], down [D, I], clipped at shared_limit) when
    path.with_shared. ROWS: `routed_experts`; FUSED and W8A8: each token's row read once per assignment straight
    from x and weighted inside the down kernel, the rows landing in [T, k, D] order, summed over k in fp32;
    GROUPED: each assignment a row (a copy) through `grouped_expert_ffn`'s sorted matmuls, then the weighted
    combine. split_sums: the sum as [S, T, D] partial sums (`routed_experts`' on ROWS, one split elsewhere)."""
    tokens, top_k = routing.experts_TK.shape
    if path.kernel is ExpertKernel.ROWS:
        with_shared = {"shared": shared, "shared_limit": shared_limit} if path.with_shared else {}
        weights = (routing.weights_TK, routing.experts_TK, *experts.stacks)
        return routed_experts(x_TD, *weights, limit, backend=path.backend, split_sums=split_sums, **with_shared)
    if split_sums:
        return moe_experts(x_TD, routing, experts, limit, path, shared=shared, shared_limit=shared_limit)[None]
    if path.kernel is ExpertKernel.GROUPED:
        rows_RD = jnp.repeat(x_TD, top_k, axis=0)
        y_RD = grouped_expert_ffn(rows_RD, routing.experts_TK.reshape(-1), experts, limit, path)
        return combine(y_RD.reshape(tokens, top_k, -1), routing.weights_TK, x_TD.dtype)
    order_R, sizes_E = sort_by_expert(routing.experts_TK.reshape(-1), experts.num_experts)
    row_weight_R = routing.weights_TK.reshape(-1)[order_R]
    y_RD = _expert_rows(x_TD, order_R // top_k, order_R, row_weight_R, sizes_E, experts, limit, path)
    return jnp.sum(y_RD.reshape(tokens, top_k, -1).astype(jnp.float32), axis=1).astype(x_TD.dtype)
