"""Expert parallelism: the routed experts of one MoE layer spread over the mesh axes of the `experts` rule.

Which mesh axes split what comes from the logical rules (`ling_jax.sharding`): the experts over those of
`experts` (the "expert axes", `expert` by default; several axes act as one, in rule order), their width over
those of `expert_mlp`, the tokens like the batch (`activation_batch`); this module names no mesh axis.
Routing happens before this (once, on every token, by `ling_jax.moe.block.route`). Inside a `shard_map` each
device owns E / ep experts (ep: the expert axes' size; with a split width, a slice of it) and
- when the tokens are split over an expert axis too (the usual case: attention is data parallel across
  it), sends each token-assignment to the device owning its expert with one all-to-all, runs its experts as
  a grouped FFN on what it received, and sends the results back with a second all-to-all;
- when they are not (fewer tokens than devices, e.g. batch-1 decode), runs its own experts on the
  assignments that pick them and sums the partial outputs over the expert axes.
Both are dropless by default: a device reserves room for every assignment a source could send it
(tokens x min(top_k, local experts)); so that this receive buffer (ep sources) stays within
`ling_jax.moe.experts.ROW_BUFFER_BYTES`, a large prefill sends its tokens in chunks, one exchange after another
(the same rows and results). A capacity factor C shrinks the room to ceil(C x tokens x top_k / n_expert) rows per
source, for all the tokens at once; assignments beyond it are dropped and counted (the MoE sows the count).

The all-to-all path moves the rows one of two ways (`ExecutionPolicy.moe_exchange`), with the same kept rows and
the same results:
- "ragged" (the default on TPU and on the GPUs of one host): `ragged_all_to_all` sends exactly the kept
  rows, each expert's rows as `SLICES_PER_EXPERT` slices, into the receiver's buffer in expert order
  (expert-major, then source), so the receiver runs its experts on contiguous groups without a sort
  (`ragged_routes`, `ragged_dispatch`, `pallas_kernels.moe.ops.expert_sorted_ffn`, `ragged_return_and_combine`).
  XLA:CPU has no ragged all-to-all; there the same collective is emulated with all-gathers
  (`emulated_ragged_all_to_all`), for tests.
- "dense" (the default on a CPU and across GPU hosts, see `resolve_exchange`): every source fills a fixed
  block per destination, so each all-to-all moves the whole reserved buffer, used or not (`dispatch`,
  `pallas_kernels.moe.ops.grouped_expert_ffn`, `return_and_combine`).
Each stage is callable inside a shard_map on its own (benchmarks/moe/expert_parallel.py times them separately).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ling_jax.moe.experts import in_token_chunks, token_chunks
from ling_jax.policy import ExecutionPolicy, MoEExchange
from ling_jax.sharding import axes_size, batch_axes, mesh_axes
from pallas_kernels.moe.ops import ExpertWeights, Routing, expert_path, expert_sorted_ffn, grouped_expert_ffn
from pallas_kernels.moe.reference import combine


def uses_model_parallelism(mesh) -> bool:
    """True when `mesh` (the context mesh; possibly empty) splits experts or their width."""
    return bool(mesh_axes("experts", mesh) or mesh_axes("expert_mlp", mesh))


def _expert_axes(axes: tuple[str, ...] | None) -> tuple[str, ...]:
    """Inside a shard_map: the expert axes given, else those of the `experts` rule on the context mesh."""
    return mesh_axes("experts") if axes is None else axes


def rows_per_source(tokens: int, top_k: int, num_shards: int, local_experts: int, capacity_factor: float | None) -> int:
    """Receive-buffer rows per source device: dropless bound, or the capacity-factor cap below it."""
    dropless = tokens * min(top_k, local_experts)
    if capacity_factor is None:
        return dropless
    return max(1, min(dropless, math.ceil(capacity_factor * tokens * top_k / num_shards)))


def _psum_f32(y, axes):
    """Partial expert outputs summed in fp32 (as one device's matmul would accumulate them)."""
    return jax.lax.psum(y.astype(jnp.float32), axes) if axes else y.astype(jnp.float32)


def _replicated_tokens(x_TD, weights_TK, experts_TK, experts: ExpertWeights, *, limit, path, ep_axes, tp_axes):
    tokens, top_k = experts_TK.shape
    first = jax.lax.axis_index(ep_axes) * experts.num_experts if ep_axes else 0

    def routed(x_TD, weights_TK, experts_TK):
        y_RD = grouped_expert_ffn(jnp.repeat(x_TD, top_k, axis=0), experts_TK.reshape(-1) - first, experts, limit, path)
        y_TD = combine(y_RD.reshape(x_TD.shape[0], top_k, -1), weights_TK, jnp.float32)
        return _psum_f32(y_TD, ep_axes + tp_axes).astype(x_TD.dtype)

    chunks = token_chunks(tokens, top_k, x_TD.shape[1] * x_TD.dtype.itemsize)
    return in_token_chunks(routed, chunks, x_TD, weights_TK, experts_TK), jnp.int32(0)


def exchange(a, ep: int, axes: tuple[str, ...] | None = None):
    """Inside a shard_map over the expert axes (`axes`, default from the rules): row block d of `a` (ep equal
    blocks) goes to device d along them; block s of the result came from device s."""
    return jax.lax.all_to_all(a.reshape(ep, -1, *a.shape[1:]), _expert_axes(axes), 0, 0).reshape(a.shape)


def _rank_and_kept(dest_A, *, ep: int, capacity: int):
    """Each token-assignment's order among this device's assignments to the same destination (token-major), and
    whether it fits that destination's `capacity` rows."""
    rank_A = (
        jnp.take_along_axis(jnp.cumsum(jax.nn.one_hot(dest_A, ep, dtype=jnp.int32), axis=0), dest_A[:, None], axis=1)[
            :, 0
        ]
        - 1
    )
    return rank_A, rank_A < capacity


def dispatch(x_TD, experts_TK, *, ep: int, local_experts: int, capacity: int, axes: tuple[str, ...] | None = None):
    """Inside a shard_map: packs each token-assignment into the block of the device owning its expert (at most
    `capacity` rows per destination; the rest are dropped) and sends the blocks with one all-to-all.

    -> (x_RD, expert_R): the ep * capacity rows this device received and their local expert ids
    (`local_experts` marks an unused slot); slot_A, kept_A: where each of this device's token-assignments went
    and whether it was kept, for `return_and_combine`.
    """
    top_k = experts_TK.shape[1]
    experts_A = experts_TK.reshape(-1)  # one entry per token-assignment, token-major
    dest_A = experts_A // local_experts
    rank_A, kept_A = _rank_and_kept(dest_A, ep=ep, capacity=capacity)
    slot_A = jnp.where(kept_A, dest_A * capacity + rank_A, ep * capacity)  # out of range: dropped
    send_x = (
        jnp.zeros((ep * capacity, x_TD.shape[1]), x_TD.dtype)
        .at[slot_A]
        .set(jnp.repeat(x_TD, top_k, axis=0), mode="drop")
    )
    send_expert = (
        jnp.full((ep * capacity,), local_experts, jnp.int32).at[slot_A].set(experts_A % local_experts, mode="drop")
    )  # unused slots name no local expert: skipped
    return exchange(send_x, ep, axes), exchange(send_expert, ep, axes), slot_A, kept_A


def return_and_combine(
    y_RD, slot_A, kept_A, weights_TK, *, ep: int, tp_axes: tuple[str, ...], dtype, axes: tuple[str, ...] | None = None
):
    """Inside a shard_map: the expert outputs of the received rows (partial sums over `tp_axes`, summed here)
    go back to their source devices with a second all-to-all, and each token's k results are summed with its
    routing weights (dropped assignments count 0). -> [T, D] in `dtype`."""
    tokens, top_k = weights_TK.shape
    y_back = exchange(_psum_f32(y_RD, tp_axes).astype(dtype), ep, axes)
    y_A = jnp.where(kept_A[:, None], y_back[jnp.minimum(slot_A, y_back.shape[0] - 1)], 0)
    return combine(y_A.reshape(tokens, top_k, -1), weights_TK, dtype)


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name: str
):
    """`jax.lax.ragged_all_to_all`'s result built from all-gathers, for backends without it (XLA:CPU): every
    device gathers every operand and slice table and copies the slices addressed to it. recv_sizes is implied
    by the senders' tables and not read. Memory: axis size x operand per device; for tests."""
    del recv_sizes
    me, devices = jax.lax.axis_index(axis_name), jax.lax.axis_size(axis_name)
    per_device = input_offsets.shape[0] // devices

    def gathered_to_me(table_K):  # [devices * per_device]: the slices each source sends this device
        return jax.lax.dynamic_slice_in_dim(
            jax.lax.all_gather(table_K, axis_name), me * per_device, per_device, axis=1
        ).reshape(-1)

    start_S, size_S, at_S = (gathered_to_me(t) for t in (input_offsets, send_sizes, output_offsets))
    row_M = jnp.arange(output.shape[0])
    inside_MS = (row_M[:, None] >= at_S) & (row_M[:, None] < at_S + size_S)
    slice_M = jnp.argmax(inside_MS, axis=1)
    source_row_M = jnp.clip(start_S[slice_M] + row_M - at_S[slice_M], 0, operand.shape[0] - 1)
    received = jax.lax.all_gather(operand, axis_name)[slice_M // per_device, source_row_M]
    covered = jnp.any(inside_MS, axis=1).reshape(-1, *(1,) * (operand.ndim - 1))
    return jnp.where(covered, received, output)


# Slices each expert's rows are cut into for the ragged all-to-all: XLA's GPU ragged all-to-all copies each
# slice with its own thread blocks, so few slices are slow (one block per destination: 2.7 GB/s between two
# H200s; one slice per expert 88-91 GB/s). On 2 H200s at 8192 tokens per device, dispatch + combine took
# 4.59 ms with 4 slices per expert against 5.02 ms with 1 in one run, 4.73-4.86 ms with 4 in the next (the
# spread between runs); at 64 tokens per device 16 and 64 slices cost 1.4x and 2.5x; BENCHMARKS.md.
SLICES_PER_EXPERT = 4


class RaggedRoutes(NamedTuple):
    """One device's side of the ragged exchange (inside a shard_map over the expert axis), P = slices per
    expert: slices e * P .. e * P + P - 1 of the sends are global expert e's kept rows, bound for device e // L;
    slices (s * L + j) * P + p of the receives are what source s sends for local expert j. The receive buffer
    is in expert order: local expert j's rows from source 0, then source 1, ..."""

    order_A: jax.Array  # [A] token-assignments sorted by global expert, dropped ones last
    kept_A: jax.Array  # [A] bool: within the destination's capacity
    send_sizes: jax.Array  # [E * P] rows this device sends per slice
    send_offsets: jax.Array  # [E * P] where each slice starts among this device's sorted rows
    remote_offsets: jax.Array  # [E * P] where it lands in its receiver's buffer
    recv_sizes: jax.Array  # [ep * L * P] rows received per slice
    recv_offsets: jax.Array  # [ep * L * P] where they sit in this device's buffer
    remote_send_offsets: jax.Array  # [ep * L * P] where the source's slice started among its sorted rows
    group_sizes_L: jax.Array  # [L] received rows per local expert


def _cut(sizes_X, starts, pieces: int):
    """Each slice of sizes_X cut into `pieces` consecutive parts: the parts' sizes [X * pieces] and, for each
    table of slice starts in `starts`, the parts' starts [X * pieces]."""
    part_P = jnp.arange(pieces, dtype=sizes_X.dtype)
    cut_XP = sizes_X[..., None] * part_P // pieces
    part_sizes = (sizes_X[..., None] * (part_P + 1) // pieces - cut_XP).reshape(-1)
    return part_sizes, tuple((table_X[..., None] + cut_XP).reshape(-1) for table_X in starts)


def ragged_routes(
    experts_TK,
    *,
    ep: int,
    local_experts: int,
    capacity: int,
    slices_per_expert: int = SLICES_PER_EXPERT,
    axes: tuple[str, ...] | None = None,
) -> RaggedRoutes:
    """Inside a shard_map: the slice tables of both ragged exchanges, from every device's per-expert counts (one
    all-gather of [E] int32). The kept rows are `dispatch`'s: the first `capacity` per destination."""
    num_experts = ep * local_experts
    experts_A = experts_TK.reshape(-1)
    _, kept_A = _rank_and_kept(experts_A // local_experts, ep=ep, capacity=capacity)
    key_A = jnp.where(kept_A, experts_A, num_experts)
    order_A = jnp.argsort(key_A, stable=True)
    sent_E = jnp.zeros((num_experts + 1,), jnp.int32).at[key_A].add(1)[:num_experts]
    axes = _expert_axes(axes)
    sent_SE = jax.lax.all_gather(sent_E, axes)  # [source, global expert]
    send_offsets_SE = jnp.cumsum(sent_SE, axis=1) - sent_SE
    earlier_sources_SE = jnp.cumsum(sent_SE, axis=0) - sent_SE
    total_DL = jnp.sum(sent_SE, axis=0).reshape(ep, local_experts)
    expert_start_E = (jnp.cumsum(total_DL, axis=1) - total_DL).reshape(-1)  # in its receiver's buffer
    me = jax.lax.axis_index(axes)

    def mine(table_SE):  # [ep * L]: the columns of this device's local experts, source-major
        return jax.lax.dynamic_slice_in_dim(table_SE, me * local_experts, local_experts, axis=1).reshape(-1)

    local_start_SL = jnp.tile(jax.lax.dynamic_slice_in_dim(expert_start_E, me * local_experts, local_experts), ep)
    send_sizes, (send_offsets, remote_offsets) = _cut(
        sent_E, (send_offsets_SE[me], expert_start_E + earlier_sources_SE[me]), slices_per_expert
    )
    recv_sizes, (recv_offsets, remote_send_offsets) = _cut(
        mine(sent_SE), (local_start_SL + mine(earlier_sources_SE), mine(send_offsets_SE)), slices_per_expert
    )
    return RaggedRoutes(
        order_A=order_A,
        kept_A=kept_A,
        send_sizes=send_sizes,
        send_offsets=send_offsets,
        remote_offsets=remote_offsets,
        recv_sizes=recv_sizes,
        recv_offsets=recv_offsets,
        remote_send_offsets=remote_send_offsets,
        group_sizes_L=total_DL[me],
    )


def _ragged_exchange(native: bool):
    return jax.lax.ragged_all_to_all if native else emulated_ragged_all_to_all


def ragged_dispatch(x_TD, routes: RaggedRoutes, *, rows: int, native: bool, axes: tuple[str, ...] | None = None):
    """Inside a shard_map: each kept token-assignment's row goes to its expert's device. -> [rows, D], this
    device's received rows in expert order (`routes.group_sizes_L`); rows past their sum are zeros."""
    top_k = routes.order_A.shape[0] // x_TD.shape[0]
    return _ragged_exchange(native)(
        x_TD[routes.order_A // top_k],
        jnp.zeros((rows, x_TD.shape[1]), x_TD.dtype),
        routes.send_offsets,
        routes.send_sizes,
        routes.remote_offsets,
        routes.recv_sizes,
        axis_name=_expert_axes(axes),
    )


def ragged_return_and_combine(
    y_RD,
    routes: RaggedRoutes,
    weights_TK,
    *,
    tp_axes: tuple[str, ...],
    dtype,
    native: bool,
    axes: tuple[str, ...] | None = None,
):
    """Inside a shard_map: the received rows' expert outputs (partial sums over `tp_axes`, summed here) go back
    to their sources, into the sorted order they left in, and each token's k results are summed with its
    routing weights (dropped assignments count 0). -> [T, D] in `dtype`."""
    tokens, top_k = weights_TK.shape
    back_AD = _ragged_exchange(native)(
        _psum_f32(y_RD, tp_axes).astype(dtype),
        jnp.zeros((tokens * top_k, y_RD.shape[1]), dtype),
        routes.recv_offsets,
        routes.recv_sizes,
        routes.remote_send_offsets,
        routes.send_sizes,
        axis_name=_expert_axes(axes),
    )
    position_A = jnp.zeros_like(routes.order_A).at[routes.order_A].set(jnp.arange(tokens * top_k))
    return combine(back_AD[position_A].reshape(tokens, top_k, -1), weights_TK, dtype)


def _exchanged_experts(
    x_TD,
    weights_TK,
    experts_TK,
    experts: ExpertWeights,
    *,
    limit,
    path,
    ep,
    ep_axes,
    tp_axes,
    capacity,
    exchange,
    native,
):
    """Inside a shard_map: the all-to-all path on these tokens -> (routed [T, D], kept [T * top_k] bool)."""
    local_experts = experts.num_experts
    if exchange == MoEExchange.RAGGED:
        routes = ragged_routes(experts_TK, ep=ep, local_experts=local_experts, capacity=capacity, axes=ep_axes)
        x_RD = ragged_dispatch(x_TD, routes, rows=ep * capacity, native=native, axes=ep_axes)
        y_RD = expert_sorted_ffn(x_RD, routes.group_sizes_L, experts, limit, path)
        routed_TD = ragged_return_and_combine(
            y_RD, routes, weights_TK, tp_axes=tp_axes, dtype=x_TD.dtype, native=native, axes=ep_axes
        )
        return routed_TD, routes.kept_A
    x_RD, expert_R, slot_A, kept_A = dispatch(
        x_TD, experts_TK, ep=ep, local_experts=local_experts, capacity=capacity, axes=ep_axes
    )
    y_RD = grouped_expert_ffn(x_RD, expert_R, experts, limit, path)
    routed_TD = return_and_combine(
        y_RD, slot_A, kept_A, weights_TK, ep=ep, tp_axes=tp_axes, dtype=x_TD.dtype, axes=ep_axes
    )
    return routed_TD, kept_A


def _all_to_all_tokens(x_TD, weights_TK, experts_TK, experts, *, ep, capacity_factor, count_axes, **exchanged):
    """Dropless, the tokens go in as many chunks (`token_chunks`) as keep the receive buffer (ep x chunk x
    min(top_k, local experts) rows) within ROW_BUFFER_BYTES; with a capacity factor, in one piece (which rows
    are kept depends on all of them)."""
    tokens, top_k = experts_TK.shape
    local_experts = experts.num_experts
    chunks = 1
    if capacity_factor is None:
        chunks = token_chunks(tokens, ep * min(top_k, local_experts), x_TD.shape[1] * x_TD.dtype.itemsize)
    capacity = rows_per_source(tokens // chunks, top_k, ep, local_experts, capacity_factor)
    run = functools.partial(_exchanged_experts, experts=experts, ep=ep, capacity=capacity, **exchanged)
    routed_TD, kept_A = in_token_chunks(run, chunks, x_TD, weights_TK, experts_TK)
    return routed_TD, jax.lax.psum(jnp.sum(~kept_A, dtype=jnp.int32), count_axes)


def has_ragged_all_to_all() -> bool:
    """Whether the default backend runs `jax.lax.ragged_all_to_all` (XLA:CPU does not)."""
    return jax.default_backend() != "cpu"


def resolve_exchange(exchange: MoEExchange) -> MoEExchange:
    """AUTO -> RAGGED on TPU and on GPUs of one process, else DENSE. Across GPU hosts XLA's ragged all-to-all
    refuses to run without extra XLA flags (its single-host kernel does not reach other hosts and its NCCL
    fallback is off by default), so multi-process GPU runs exchange fixed-size buffers unless the policy's
    moe_exchange is "ragged"."""
    if exchange not in set(MoEExchange):
        valid = ", ".join(repr(m.value) for m in MoEExchange)
        raise ValueError(f"moe_exchange must be one of {valid}, got {exchange!r}")
    if exchange == MoEExchange.AUTO:
        backend = jax.default_backend()
        ragged = backend == "tpu" or (backend == "gpu" and jax.process_count() == 1)
        return MoEExchange.RAGGED if ragged else MoEExchange.DENSE
    return MoEExchange(exchange)


def moe_parallel(
    x_TD, routing: Routing, experts: ExpertWeights, *, limit: float | None, mesh, policy: ExecutionPolicy
) -> tuple[jax.Array, jax.Array]:
    """Routed-expert output [T, D] and the number of dropped assignments, experts split over `mesh` as the
    current rules say. policy: the kernel backend and FP8 mode (`expert_path`: the received rows never run row by
    row), the capacity factor (`moe_capacity_factor`) and how the all-to-all path moves rows (`moe_exchange`, see
    the module doc)."""
    exchange = resolve_exchange(policy.moe_exchange)
    ep_axes = mesh_axes("experts", mesh)
    tp_axes = tuple(axis for axis in mesh_axes("expert_mlp", mesh) if axis not in ep_axes)
    ep, tp = axes_size(mesh, ep_axes), axes_size(mesh, tp_axes)
    num_experts, width = experts.gate_EID.shape[:2]
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts cannot be split over the expert axes {ep_axes} ({ep} ways)")
    if width % tp:
        raise ValueError(f"moe_intermediate_size {width} cannot be split over the axes {tp_axes} ({tp} ways)")
    axes = batch_axes(mesh, x_TD.shape[0])  # tokens are split like the batch they come from
    all_to_all = bool(set(ep_axes) & set(axes))  # devices of one expert group see different tokens: exchange them
    sorted_rows = all_to_all and exchange == MoEExchange.RAGGED
    path = expert_path(policy.kernel_backend, experts, policy.fp8_matmul, sorted_rows=sorted_rows)
    common = {"limit": limit, "path": path, "ep_axes": ep_axes, "tp_axes": tp_axes}
    if all_to_all:
        body = functools.partial(
            _all_to_all_tokens,
            ep=ep,
            capacity_factor=policy.moe_capacity_factor,
            count_axes=axes,
            exchange=exchange,
            native=has_ragged_all_to_all(),
            **common,
        )
    else:
        body = functools.partial(_replicated_tokens, **common)
    tokens = P(axes or None, None)
    expert_entry, width_entry = (ep_axes or None), (tp_axes or None)
    gate_up = P(expert_entry, width_entry, None)
    down = P(expert_entry, None, width_entry)
    return jax.shard_map(
        lambda x, weights, ids, gate, up, down: body(x, weights, ids, ExpertWeights(gate, up, down)),
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, gate_up, gate_up, down),
        out_specs=(tokens, P()),
        check_vma=False,
    )(x_TD, routing.weights_TK, routing.experts_TK, *experts.stacks)
