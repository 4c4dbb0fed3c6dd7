"""Every call the MoE benchmarks make into `ling_jax.moe` and `pallas_kernels.moe` on one device, in one place: the
paths they time, the kernels they sweep and the references they check against (the expert-parallel stages are in
`benchmarks.moe.expert_parallel.stage_functions`). A change of those libraries' signatures is made here."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.moe.block import MoE
from ling_jax.moe.experts import dense_expert_ffn, local_moe, swiglu_ffn
from ling_jax.policy import ExecutionPolicy
from ling_jax.quantized import BlockFP8Weight
from pallas_kernels.backend import resolve_backend
from pallas_kernels.experimental.moe_gpu_mosaic import TILE_KEYWORDS as MOSAIC_TILE_KEYWORDS
from pallas_kernels.experimental.moe_gpu_mosaic import w8a8_expert_rows_mgpu
from pallas_kernels.experimental.moe_xla_folded import routed_experts_xla
from pallas_kernels.experimental.moe_xla_folded import takes as folded_takes
from pallas_kernels.moe import tuned
from pallas_kernels.moe.gpu_triton import row_tiles
from pallas_kernels.moe.gpu_triton.w8a8 import down_scatter_w8a8_gpu, gather_swiglu_w8a8_gpu
from pallas_kernels.moe.ops import (
    WEIGHT_ONLY,
    ExpertKernel,
    ExpertPath,
    ExpertWeights,
    Routing,
    down_scatter,
    expert_path,
    gather_swiglu,
    grouped_matmul,
    kernel,
    moe_experts,
    routed_experts,
    sort_by_expert,
)
from pallas_kernels.moe.reference import (
    RoutingRule,
    grouped_matmul_reference,
    select_experts_reference,
    swiglu,
)
from pallas_kernels.tuning import lookup

__all__ = [
    "MOSAIC_TILE_KEYWORDS",
    "WEIGHT_ONLY",
    "RoutingRule",
    "folded_takes",
    "grouped_matmul_reference",
    "row_tiles",
    "select_experts_reference",
    "tuned",
]

BASELINE_CHUNK = 512  # tokens per dense-baseline chunk: [chunk, E, D] bf16 intermediates stay ~2 GB


# --- the whole layer and its routed experts (bf16) ---


def moe_layer(config, *, dtype=jnp.bfloat16) -> MoE:
    """The MoE module at `config` with random weights, as layer 8 of the model builds it."""
    return MoE(config, clip_layer=8, dtype=dtype, rngs=nnx.Rngs(0))


def expert_stacks(moe: MoE) -> tuple:
    """(gate, up, down) expert stacks of an MoE module and its SwiGLU clip."""
    return (moe.experts.gate_proj[...], moe.experts.up_proj[...], moe.experts.down_proj[...]), moe.experts.limit


def route_tokens(moe: MoE, x_TD, backend: str):
    """(weights [T, k], experts [T, k]) from the module's router."""
    return jax.jit(functools.partial(moe.gate, policy=ExecutionPolicy(kernel_backend=backend)))(x_TD)


def dense_in_chunks(x_TD, weights_TK, experts_TK, gate, up, down, limit):
    """The dense one-hot baseline: every expert on every token, in token chunks."""
    chunks = x_TD.shape[0] // min(BASELINE_CHUNK, x_TD.shape[0])
    experts = ExpertWeights(gate, up, down)

    def one(args):
        x, weights, ids = args
        return dense_expert_ffn(x, Routing(weights, ids), experts, limit)

    split = [a.reshape(chunks, -1, *a.shape[1:]) for a in (x_TD, weights_TK, experts_TK)]
    return jax.lax.map(one, split).reshape(x_TD.shape)


def routed_jit(fn):
    """fn(x, routing, experts) jitted as (x, weights, experts, gate, up, down) -> y."""

    def run(x_TD, weights_TK, experts_TK, gate, up, down):
        return fn(x_TD, Routing(weights_TK, experts_TK), ExpertWeights(gate, up, down))

    return jax.jit(run)


def grouped_path(backend: str) -> ExpertPath:
    """The unfused path on `backend`: repeat and sort the rows, three grouped matmuls, unsort, combine."""
    return ExpertPath(ExpertKernel.GROUPED, resolve_backend(backend))


def fused_routed(limit, backend: str):
    """`local_moe` jitted (what the model runs): (x, weights, experts, gate, up, down) -> y."""
    policy = ExecutionPolicy(kernel_backend=backend)
    return routed_jit(lambda x_TD, routing, experts: local_moe(x_TD, routing, experts, limit, policy=policy))


def unfused_routed(limit, backend: str):
    """`moe_experts` on the unfused path (`grouped_path`) jitted: (x, weights, experts, gate, up, down) -> y."""
    path = grouped_path(backend)
    return routed_jit(lambda x_TD, routing, experts: moe_experts(x_TD, routing, experts, limit, path))


def unfused_gemms(rows_RD, sizes_E, gate, up, down, *, limit, backend):
    """The unfused path's kernels alone: three grouped matmuls and the SwiGLU on already repeated rows."""
    hidden_RI = swiglu(
        grouped_matmul(rows_RD, gate, sizes_E, backend=backend),
        grouped_matmul(rows_RD, up, sizes_E, backend=backend),
        limit,
    )
    return grouped_matmul(hidden_RI, down, sizes_E, backend=backend)


def fused_kernels(x_TD, source_R, order_R, row_weight_R, sizes_E, gate, up, down, *, limit, backend, variant=None):
    """The fused path's kernels alone, on an already computed permutation."""
    h_RI = gather_swiglu(x_TD, source_R, sizes_E, gate, up, limit, backend=backend, variant=variant)
    return down_scatter(h_RI, order_R, row_weight_R, sizes_E, down, backend=backend, variant=variant)


def unfused_layer(graphdef, limit, backend):
    """The whole MoE layer (router, routed experts, shared expert) with the unfused routed path, jitted over
    its split state as the model runs (nnx.jit would also return, i.e. copy, the state)."""

    policy, path = ExecutionPolicy(kernel_backend=backend), grouped_path(backend)

    def run(state, x_TD):
        moe = nnx.merge(graphdef, state)
        routing = Routing(*moe.gate(x_TD, policy=policy))
        experts = ExpertWeights(moe.experts.gate_proj[...], moe.experts.up_proj[...], moe.experts.down_proj[...])
        return moe_experts(x_TD, routing, experts, limit, path) + moe.shared_experts(x_TD)

    return jax.jit(run)


def model_layer(graphdef, backend):
    """The MoE module itself, as the model calls it (its fused path on a GPU)."""
    policy = ExecutionPolicy(kernel_backend=backend)
    return jax.jit(lambda state, x_TD: nnx.merge(graphdef, state)(x_TD, policy=policy))


def sorted_rows(x_TD, weights_TK, experts_TK, num_experts: int) -> tuple:
    """The fused kernels' row arguments: (x, source token, destination row, row weight, group sizes), rows sorted
    by expert."""
    top_k = experts_TK.shape[1]
    order_R, sizes_E = jax.jit(sort_by_expert, static_argnums=1)(experts_TK.reshape(-1), num_experts)
    return x_TD, order_R // top_k, order_R, weights_TK.reshape(-1)[order_R], sizes_E


def routed_by_expert(kernels, x_TD, weights_TK, experts_TK, gate, up, down, *, num_experts: int):
    """Sort by expert, `kernels` on the sorted rows (fused_kernels' arguments), the top-k sum in fp32: y [T, D]."""
    tokens, top_k = experts_TK.shape
    order_R, sizes_E = sort_by_expert(experts_TK.reshape(-1), num_experts)
    row_weight_R = weights_TK.reshape(-1)[order_R]
    y_RD = kernels(x_TD, order_R // top_k, order_R, row_weight_R, sizes_E, gate, up, down)
    return jnp.sum(y_RD.reshape(tokens, top_k, -1).astype(jnp.float32), axis=1).astype(x_TD.dtype)


def fused_kernel_entries(variant: str):
    """(gather_swiglu, down_scatter) of one named GPU variant, taking its tiles as keywords."""
    return kernel("gather_swiglu", variant), kernel("down_scatter", variant)


# --- the unfused path's grouped matmul ---


def grouped_matmul_tiles(**tiles):
    """The gpu_triton grouped matmul at the given tiles (none: its tuned ones): (lhs, rhs, group sizes) -> out."""
    grouped_matmul_gpu = kernel("grouped_matmul", "gpu_triton")
    return jax.jit(lambda a, b, s: grouped_matmul_gpu(a, b, s, **tiles))


# --- the row-by-row decode kernels and the expert selection ---


def row_kernel_tiles(dtype, bucket=None, *, quantized: bool) -> dict:
    """The row kernels' tuned (swiglu_tiles, down_tiles) as tuples for `tokens_bucket` bucket."""
    swiglu_table, down_table = (
        (tuned.ROUTED_SWIGLU_QUANTIZED, tuned.ROUTED_DOWN_QUANTIZED)
        if quantized
        else (tuned.ROUTED_SWIGLU, tuned.ROUTED_DOWN)
    )
    given = {} if bucket is None else {"bucket": bucket}
    return {
        "swiglu_tiles": dataclasses.astuple(lookup(swiglu_table, dtype=dtype, **given)),
        "down_tiles": dataclasses.astuple(lookup(down_table, dtype=dtype, **given)),
    }


def row_kernels(limit, variant: str = "gpu_triton", **launch):
    """The row kernels of `variant` with the shared expert: (x, weights, experts, gate, up, down, shared) -> y;
    launch: tiles and interpret."""
    return functools.partial(kernel("routed_experts", variant), limit=limit, shared_limit=limit, **launch)


def grouped_with_shared(limit):
    """The grouped path (sort, grouped matmuls, combine) then the shared expert, as a decode step ran them."""

    def grouped(x, weights, experts, gate, up, down, shared):
        stacks = ExpertWeights(gate, up, down)
        routed = moe_experts(x, Routing(weights, experts), stacks, limit, expert_path("pallas_gpu", stacks))
        return routed + swiglu_ffn(x, *shared, limit)

    return grouped


def select_experts_tiles(rule, num_warps: int):
    """The expert-selection kernel (one token a program) at num_warps: (logits, bias) -> (weights, experts)."""
    return functools.partial(kernel("select_experts", "gpu_triton"), rule=rule, num_warps=num_warps)


def routed_rows(limit, backend: str, variant: str | None = None):
    """`ops.routed_experts` jitted, its variant picked by the weights (or named): the row kernels up to 64 rows."""
    return jax.jit(functools.partial(routed_experts, limit=limit, backend=backend, variant=variant))


def folded_rows(limit):
    """`pallas_kernels.experimental.moe_xla_folded`: XLA's gather + reduction over FP8 experts, no Pallas."""
    return functools.partial(routed_experts_xla, limit=limit)


# --- W8A8 experts ---


def w8a8_kernels(x_TD, source_R, order_R, row_weight_R, sizes_E, gate, up, down, *, limit, block, interpret):
    """The Triton W8A8 kernels on sorted rows; gate / up / down: (e4m3 values, fp32 scales) pairs."""
    h_q, h_scale = gather_swiglu_w8a8_gpu(
        x_TD, source_R, sizes_E, *gate, *up, limit=limit, block=block, interpret=interpret
    )
    return down_scatter_w8a8_gpu(
        h_q, h_scale, order_R, row_weight_R, sizes_E, *down, block=block, out_dtype=x_TD.dtype, interpret=interpret
    )


def mosaic_kernels(x_TD, source_R, order_R, row_weight_R, sizes_E, gate, up, down, *, limit, block, **tiles):
    """The Mosaic GPU W8A8 kernels on sorted rows, the same (values, scales) pairs."""
    gate, up, down = (BlockFP8Weight(*weight, block) for weight in (gate, up, down))
    return w8a8_expert_rows_mgpu(x_TD, source_R, order_R, row_weight_R, sizes_E, gate, up, down, limit, **tiles)


def w8a8_kernel_calls(kernel_args, *, limit, block, interpret) -> dict:
    """{kernel: (entry taking its tiles as keywords, its arguments)} of the two Triton W8A8 kernels alone."""
    x_TD, source_R, order_R, row_weight_R, sizes_E, gate, up, down = kernel_args
    h_q, h_scale = gather_swiglu_w8a8_gpu(
        x_TD, source_R, sizes_E, *gate, *up, limit=limit, block=block, interpret=interpret
    )
    return {
        "gather_swiglu_w8a8": (
            functools.partial(gather_swiglu_w8a8_gpu, limit=limit, block=block, interpret=interpret),
            (x_TD, source_R, sizes_E, *gate, *up),
        ),
        "down_scatter_w8a8": (
            functools.partial(down_scatter_w8a8_gpu, block=block, interpret=interpret),
            (h_q, h_scale, order_R, row_weight_R, sizes_E, *down),
        ),
    }
