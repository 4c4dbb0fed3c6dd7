"""Expert parallelism: the routed experts of one MoE layer spread over the mesh's `expert` axis.

Routing happens before this (once, on every token, by `ling_jax.moe.route`). Inside a `shard_map` each
device owns E / n_expert experts (and, with a `tensor` axis, a slice of their width) and
- when the tokens are split over the expert axis too (the usual case: attention is data parallel across
  it), sends each token-assignment to the device owning its expert with one all-to-all, runs its experts as
  a grouped FFN on what it received, and sends the results back with a second all-to-all;
- when they are not (fewer tokens than devices, e.g. batch-1 decode), runs its own experts on the
  assignments that pick them and sums the partial outputs over the expert axis.
Both are dropless by default: a device reserves room for every assignment a source could send it
(tokens x min(top_k, local experts)). A capacity factor C shrinks that to ceil(C x tokens x top_k /
n_expert) rows per source; assignments beyond it are dropped and counted (the MoE sows the count).
`ragged_all_to_all` would avoid the fixed-size buffers but is not implemented on the CPU backend.
The all-to-all path is three stages, `dispatch`, `grouped_expert_ffn` and `return_and_combine`, each callable
inside a shard_map on its own (scripts/bench_expert_parallel.py times them separately).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ling_jax.expert_ffn import combine, grouped_expert_ffn
from ling_jax.sharding import batch_axes


def uses_model_parallelism(mesh) -> bool:
    """True when `mesh` (the context mesh; possibly empty) splits experts or their width."""
    return not mesh.empty and any(mesh.shape.get(axis, 1) > 1 for axis in ("expert", "tensor"))


def rows_per_source(tokens: int, top_k: int, num_shards: int, local_experts: int,
                    capacity_factor: float | None) -> int:
    """Receive-buffer rows per source device: dropless bound, or the capacity-factor cap below it."""
    dropless = tokens * min(top_k, local_experts)
    if capacity_factor is None:
        return dropless
    return max(1, min(dropless, math.ceil(capacity_factor * tokens * top_k / num_shards)))


def _psum_f32(y, axes):
    """Partial expert outputs summed in fp32 (as one device's matmul would accumulate them)."""
    return jax.lax.psum(y.astype(jnp.float32), axes) if axes else y.astype(jnp.float32)


def _replicated_tokens(x_TD, weights_TK, experts_TK, gate, up, down, *, limit, backend, ep, tp_axes):
    tokens, top_k = experts_TK.shape
    first = jax.lax.axis_index("expert") * gate.shape[0] if ep > 1 else 0
    y_RD = grouped_expert_ffn(jnp.repeat(x_TD, top_k, axis=0), experts_TK.reshape(-1) - first, gate, up, down,
                              limit, backend=backend)
    y_TD = combine(y_RD.reshape(tokens, top_k, -1), weights_TK, jnp.float32)
    summed = _psum_f32(y_TD, (("expert",) if ep > 1 else ()) + tp_axes)
    return summed.astype(x_TD.dtype), jnp.int32(0)


def exchange(a, ep: int):
    """Inside a shard_map over the expert axis: row block d of `a` (ep equal blocks) goes to device d; block s
    of the result came from device s."""
    return jax.lax.all_to_all(a.reshape(ep, -1, *a.shape[1:]), "expert", 0, 0).reshape(a.shape)


def dispatch(x_TD, experts_TK, *, ep: int, local_experts: int, capacity: int):
    """Inside a shard_map: packs each token-assignment into the block of the device owning its expert (at most
    `capacity` rows per destination; the rest are dropped) and sends the blocks with one all-to-all.

    -> (x_RD, expert_R): the ep * capacity rows this device received and their local expert ids
    (`local_experts` marks an unused slot); slot_A, kept_A: where each of this device's token-assignments went
    and whether it was kept, for `return_and_combine`.
    """
    top_k = experts_TK.shape[1]
    experts_A = experts_TK.reshape(-1)  # one entry per token-assignment, token-major
    dest_A = experts_A // local_experts
    rank_A = jnp.take_along_axis(jnp.cumsum(jax.nn.one_hot(dest_A, ep, dtype=jnp.int32), axis=0),
                                 dest_A[:, None], axis=1)[:, 0] - 1  # order among assignments to the same device
    kept_A = rank_A < capacity
    slot_A = jnp.where(kept_A, dest_A * capacity + rank_A, ep * capacity)  # out of range: dropped
    send_x = jnp.zeros((ep * capacity, x_TD.shape[1]), x_TD.dtype).at[slot_A].set(
        jnp.repeat(x_TD, top_k, axis=0), mode="drop")
    send_expert = jnp.full((ep * capacity,), local_experts, jnp.int32).at[slot_A].set(
        experts_A % local_experts, mode="drop")  # unused slots name no local expert: skipped
    return exchange(send_x, ep), exchange(send_expert, ep), slot_A, kept_A


def return_and_combine(y_RD, slot_A, kept_A, weights_TK, *, ep: int, tp_axes: tuple[str, ...], dtype):
    """Inside a shard_map: the expert outputs of the received rows (partial sums over `tp_axes`, summed here)
    go back to their source devices with a second all-to-all, and each token's k results are summed with its
    routing weights (dropped assignments count 0). -> [T, D] in `dtype`."""
    tokens, top_k = weights_TK.shape
    y_back = exchange(_psum_f32(y_RD, tp_axes).astype(dtype), ep)
    y_A = jnp.where(kept_A[:, None], y_back[jnp.minimum(slot_A, y_back.shape[0] - 1)], 0)
    return combine(y_A.reshape(tokens, top_k, -1), weights_TK, dtype)


def _all_to_all_tokens(x_TD, weights_TK, experts_TK, gate, up, down, *, limit, backend, ep, tp_axes,
                       capacity_factor, count_axes):
    tokens, top_k = experts_TK.shape
    local_experts = gate.shape[0]
    capacity = rows_per_source(tokens, top_k, ep, local_experts, capacity_factor)
    x_RD, expert_R, slot_A, kept_A = dispatch(x_TD, experts_TK, ep=ep, local_experts=local_experts,
                                              capacity=capacity)
    y_RD = grouped_expert_ffn(x_RD, expert_R, gate, up, down, limit, backend=backend)
    dropped = jax.lax.psum(jnp.sum(~kept_A, dtype=jnp.int32), count_axes)
    return return_and_combine(y_RD, slot_A, kept_A, weights_TK, ep=ep, tp_axes=tp_axes, dtype=x_TD.dtype), dropped


def moe_parallel(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, *, limit: float | None, mesh,
                 capacity_factor: float | None, backend: str):
    """Routed-expert output [T, D] and the number of dropped assignments, experts split over `mesh`."""
    ep = mesh.shape.get("expert", 1)
    tp = mesh.shape.get("tensor", 1)
    num_experts, width = gate_EID.shape[:2]
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts cannot be split over the expert axis of size {ep}")
    if width % tp:
        raise ValueError(f"moe_intermediate_size {width} cannot be split over the tensor axis of size {tp}")
    axes = batch_axes(mesh, x_TD.shape[0])  # tokens are split like the batch they come from
    expert_axis = "expert" if ep > 1 else None
    tensor_axis = "tensor" if tp > 1 else None
    tp_axes = ("tensor",) if tp > 1 else ()
    common = {"limit": limit, "backend": backend, "ep": ep, "tp_axes": tp_axes}
    if "expert" in axes:
        body = functools.partial(_all_to_all_tokens, capacity_factor=capacity_factor, count_axes=axes, **common)
    else:
        body = functools.partial(_replicated_tokens, **common)
    tokens = P(axes or None, None)
    gate_up = P(expert_axis, tensor_axis, None)
    down = P(expert_axis, None, tensor_axis)
    return jax.shard_map(body, mesh=mesh, in_specs=(tokens, tokens, tokens, gate_up, gate_up, down),
                         out_specs=(tokens, P()), check_vma=False)(
        x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI)
