"""The routed experts' arithmetic, independent of where they live: SwiGLU (with the optional clip), the
grouped FFN over rows sorted by expert, the weighted combine, and the one-hot dense baseline.

On a GPU backend the grouped FFN is two fused kernels (`pallas_kernels.moe.gather_swiglu`, `down_scatter`):
rows are read from the unsorted activations through the sort permutation and written back through it, so
neither a sorted copy of the rows nor an unsort pass exists; elsewhere it is three jnp ragged dots.

Expert weights may be quantised (`ling_jax.quantized`, block FP8 or MXFP4, stacked [E, ...] with per-expert
scales). On a GPU backend the fused kernels read them as stored (`pallas_kernels.moe`'s weight-only variant, each
tile dequantised on chip) and the row-by-row decode kernels dequantise only the picked experts; elsewhere the
grouped path dequantises the experts of this layer (expert-parallel, of this device) inside the step
(`dequantized`).

A step whose [rows, hidden] buffers would exceed ROW_BUFFER_BYTES (a large prefill chunk) runs the routed experts
on its tokens in chunks, one after another (`token_chunks`, `in_token_chunks`; expert-parallel, see
`ling_jax.moe.expert_parallel`), every row computed as in one piece.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ling_jax.layers import fp8_matmul_in_scope, project
from ling_jax.policy import ExecutionPolicy, FP8Matmul
from ling_jax.quantized import dequantized
from pallas_kernels.backend import KERNEL_TARGET, resolve_backend
from pallas_kernels.moe.ops import (
    down_scatter,
    gather_swiglu,
    grouped_matmul,
    routed_experts,
    w8a8_expert_rows,
    w8a8_takes,
)
from pallas_kernels.moe.reference import swiglu

# Up to this many token-expert rows (8 tokens at top-8), a GPU runs the routed experts row by row
# (`pallas_kernels.moe.routed_experts`: no sort, each row streams its expert), above it the grouped path.
ROW_PATH_MAX_ROWS = 64

# A step whose [rows, hidden] buffers of the routed experts (per device) would exceed this many bytes runs them on
# its tokens in chunks, one after another (`token_chunks`, `in_token_chunks`): a large prefill chunk.
ROW_BUFFER_BYTES = 1 << 30


class SharedExpert(NamedTuple):
    """The MoE's shared expert: SwiGLU weights in the checkpoint's [out, in] layout (arrays or quantised weights)
    and its clip."""

    gate_ID: jax.Array
    up_ID: jax.Array
    down_DI: jax.Array
    limit: float | None


def swiglu_ffn(x, gate_ID, up_ID, down_DI, limit: float | None, policy: ExecutionPolicy | None = None) -> jax.Array:
    """down(swiglu(gate(x), up(x), limit)), each product a `project` (the weights cast or dequantised to x's dtype,
    or the FP8 kernels as the policy says): the dense MLP and shared expert."""
    linear = functools.partial(project, policy=policy)
    return linear(swiglu(linear(x, gate_ID), linear(x, up_ID), limit), down_DI)


def expert_load(experts_TK, num_experts: int) -> jax.Array:
    """[E] float32: how many token-assignments each expert received (for balancing and reports)."""
    return jnp.zeros((num_experts,), jnp.float32).at[experts_TK.reshape(-1)].add(1.0)


def sort_by_expert(expert_R, num_experts: int):
    """(order [R]: row indices sorted by expert, stable; sizes [E] int32: rows per expert). Rows whose expert
    is outside [0, E) sort last and count in no group."""
    key_R = jnp.where((expert_R >= 0) & (expert_R < num_experts), expert_R, num_experts)
    order_R = jnp.argsort(key_R, stable=True)
    sizes_E = jnp.zeros((num_experts + 1,), jnp.int32).at[key_R].add(1)[:num_experts]
    return order_R, sizes_E


def _runs_gpu_kernels(backend: str) -> bool:
    return KERNEL_TARGET.get(resolve_backend(backend)) == "gpu"


def runs_w8a8(gate_EID, up_EID, down_EDI) -> bool:
    """Whether the routed experts run in W8A8 (`pallas_kernels.moe.w8a8_expert_rows`, on every backend: the kernels
    on a GPU, the jnp reference elsewhere): the enclosing `fp8_matmul_scope` says W8A8 and the experts are block-FP8
    stacks it takes. Then every call takes the grouped path, the decode row path included (which has no W8A8
    kernels), so that a token's output does not depend on how many rows share its call. `auto` stays weight-only
    (the dequantised experts' numerics, as the transformers reference computes them)."""
    return fp8_matmul_in_scope() is FP8Matmul.W8A8 and w8a8_takes(gate_EID, up_EID, down_EDI)


def fused_expert_rows(
    x_XD,
    source_R,
    order_R,
    row_weight_R,
    sizes_E,
    gate_EID,
    up_EID,
    down_EDI,
    limit: float | None,
    *,
    backend: str,
    fill_tail: bool = True,
):
    """[R, D] in x's dtype: row order[r] of the result = row_weight[r] * FFN_g(x[source[r]]) for the r-th row of
    the expert order (group g); rows past sum(sizes) are 0, or undefined with fill_tail False (not computed).
    The GPU's two fused kernels, weight-only ones for quantised experts (read as stored), or the W8A8 ones
    (`runs_w8a8`)."""
    if runs_w8a8(gate_EID, up_EID, down_EDI):
        return w8a8_expert_rows(
            x_XD,
            source_R,
            order_R,
            row_weight_R,
            sizes_E,
            gate_EID,
            up_EID,
            down_EDI,
            limit,
            backend=backend,
            fill_tail=fill_tail,
        )
    h_RI = gather_swiglu(x_XD, source_R, sizes_E, gate_EID, up_EID, limit, backend=backend, fill_tail=fill_tail)
    return down_scatter(h_RI, order_R, row_weight_R, sizes_E, down_EDI, backend=backend, fill_tail=fill_tail)


def sorted_expert_ffn(x_RD, expert_R, gate_EID, up_EID, down_EDI, limit: float | None, *, backend: str):
    """`grouped_expert_ffn` unfused, on any backend: rows sorted by expert (a copy), three grouped matmuls
    (`pallas_kernels.moe.grouped_matmul`), the SwiGLU between them, and the rows put back in order."""
    order_R, sizes_E = sort_by_expert(expert_R, gate_EID.shape[0])
    y_sorted = _three_grouped_matmuls(x_RD[order_R], sizes_E, gate_EID, up_EID, down_EDI, limit, backend=backend)
    return jnp.zeros_like(y_sorted).at[order_R].set(y_sorted)


def _three_grouped_matmuls(x_RD, sizes_E, gate_EID, up_EID, down_EDI, limit: float | None, *, backend: str):
    """Quantised stacks go to `grouped_matmul` as stored (the TPU kernel dequantises each tile in VMEM, the reference
    one layer inside the step); the GPU grouped-matmul kernel takes dense weights."""
    if _runs_gpu_kernels(backend):
        gate_EID, up_EID, down_EDI = (dequantized(w, x_RD.dtype) for w in (gate_EID, up_EID, down_EDI))
    hidden_RI = swiglu(
        grouped_matmul(x_RD, gate_EID, sizes_E, backend=backend),
        grouped_matmul(x_RD, up_EID, sizes_E, backend=backend),
        limit,
    )
    return grouped_matmul(hidden_RI, down_EDI, sizes_E, backend=backend)


def expert_sorted_ffn(x_RD, sizes_E, gate_EID, up_EID, down_EDI, limit: float | None, *, backend: str):
    """The experts on rows already in expert order: rows [sum(sizes[:e]), sum(sizes[:e + 1])) go through expert
    e; rows past sum(sizes) are undefined: on a GPU backend `fused_expert_rows` with identity permutations (no
    copy) neither computes nor writes them (a dropless receive buffer is mostly such rows), elsewhere three
    grouped matmuls give zeros there."""
    if not _runs_gpu_kernels(backend):
        return _three_grouped_matmuls(x_RD, sizes_E, gate_EID, up_EID, down_EDI, limit, backend=backend)
    identity_R = jnp.arange(x_RD.shape[0], dtype=jnp.int32)
    return fused_expert_rows(
        x_RD,
        identity_R,
        identity_R,
        jnp.ones(identity_R.shape, jnp.float32),
        sizes_E,
        gate_EID,
        up_EID,
        down_EDI,
        limit,
        backend=backend,
        fill_tail=False,
    )


def grouped_expert_ffn(x_RD, expert_R, gate_EID, up_EID, down_EDI, limit: float | None, *, backend: str):
    """SwiGLU experts applied row-wise: row r goes through expert expert_R[r] of the E given ones.

    Rows whose expert is outside [0, E) are skipped (their output is 0): the caller marks rows routed to
    other devices, or unused buffer slots, that way. On a GPU backend: `fused_expert_rows` over the rows in
    expert order; elsewhere `sorted_expert_ffn`.
    """
    if not (_runs_gpu_kernels(backend) or runs_w8a8(gate_EID, up_EID, down_EDI)):
        return sorted_expert_ffn(x_RD, expert_R, gate_EID, up_EID, down_EDI, limit, backend=backend)
    order_R, sizes_E = sort_by_expert(expert_R, gate_EID.shape[0])
    return fused_expert_rows(
        x_RD,
        order_R,
        order_R,
        jnp.ones(order_R.shape, jnp.float32),
        sizes_E,
        gate_EID,
        up_EID,
        down_EDI,
        limit,
        backend=backend,
    )


def token_chunks(tokens: int, rows_per_token: int, row_bytes: int) -> int:
    """How many chunks of `tokens` the routed experts run on, one after another, so that a buffer of rows_per_token
    rows of row_bytes each per token stays within ROW_BUFFER_BYTES (1 when the whole step fits)."""
    return -(-tokens // max(1, ROW_BUFFER_BYTES // (rows_per_token * row_bytes)))


def in_token_chunks(fn, chunks: int, *token_arrays):
    """fn(*token_arrays) computed on `chunks` equal slices of the arrays' leading (token-major) axis in a loop
    (`lax.map`), each output's slices put back together along its leading axis; fn itself for one chunk. The
    tokens are padded to a multiple of `chunks` with zeros (the padding's outputs are dropped): a padding token
    is routed to expert 0 with weight 0."""
    if chunks <= 1:
        return fn(*token_arrays)
    tokens = token_arrays[0].shape[0]
    padded = -(-tokens // chunks) * chunks
    sliced = [
        jnp.pad(a, [(0, padded - tokens)] + [(0, 0)] * (a.ndim - 1)).reshape(chunks, padded // chunks, *a.shape[1:])
        for a in token_arrays
    ]
    out = jax.lax.map(lambda arrays: fn(*arrays), sliced)
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:])[: a.shape[0] * a.shape[1] * tokens // padded], out)


def combine(y_TKD, weights_TK, dtype) -> jax.Array:
    """sum_k weights[t, k] * y[t, k] in fp32, cast to the activation dtype."""
    return jnp.einsum("tkd,tk->td", y_TKD.astype(jnp.float32), weights_TK.astype(jnp.float32)).astype(dtype)


def dense_expert_ffn(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, limit: float | None):
    """The one-hot baseline: every expert sees every token and the routing weights zero out the rest.

    Exact and simple, E / top_k times the work of the grouped path; kept as the benchmark baseline and as an
    independent check of the grouped and expert-parallel paths.
    """
    dtype = x_TD.dtype
    combine_TE = jnp.zeros((x_TD.shape[0], gate_EID.shape[0]), jnp.float32)
    combine_TE = combine_TE.at[jnp.arange(x_TD.shape[0])[:, None], experts_TK].add(weights_TK)
    gate = jnp.einsum("td,eid->tei", x_TD, dequantized(gate_EID, dtype))
    up = jnp.einsum("td,eid->tei", x_TD, dequantized(up_EID, dtype))
    y_TED = jnp.einsum("tei,edi->ted", swiglu(gate, up, limit), dequantized(down_EDI, dtype))
    return jnp.einsum("ted,te->td", y_TED.astype(jnp.float32), combine_TE).astype(dtype)


def unfused_local_moe(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, limit: float | None, *, backend: str):
    """All experts on this device, on any backend: each token's k assignments become k rows (a copy) of
    `sorted_expert_ffn`, then the weighted combine."""
    tokens, top_k = experts_TK.shape
    rows_D = jnp.repeat(x_TD, top_k, axis=0)
    y_RD = sorted_expert_ffn(rows_D, experts_TK.reshape(-1), gate_EID, up_EID, down_EDI, limit, backend=backend)
    return combine(y_RD.reshape(tokens, top_k, -1), weights_TK, x_TD.dtype)


def fused_local_moe(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, limit: float | None, *, backend: str):
    """All experts on this device, GPU backends: `fused_expert_rows` reads each token's row once per
    assignment straight from x and weights it inside the down kernel; the rows land in [T, k, D] order, so the
    combine is a sum over k (in fp32)."""
    tokens, top_k = experts_TK.shape
    order_R, sizes_E = sort_by_expert(experts_TK.reshape(-1), gate_EID.shape[0])
    y_RD = fused_expert_rows(
        x_TD,
        order_R // top_k,
        order_R,
        weights_TK.reshape(-1)[order_R],
        sizes_E,
        gate_EID,
        up_EID,
        down_EDI,
        limit,
        backend=backend,
    )
    return jnp.sum(y_RD.reshape(tokens, top_k, -1).astype(jnp.float32), axis=1).astype(x_TD.dtype)


def grouped_local_moe(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, limit: float | None, *, backend: str):
    """All experts on this device as one grouped FFN: `fused_local_moe` on a GPU backend or in W8A8 (`runs_w8a8`),
    else `unfused_local_moe`."""
    fused = _runs_gpu_kernels(backend) or runs_w8a8(gate_EID, up_EID, down_EDI)
    local = fused_local_moe if fused else unfused_local_moe
    return local(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, limit, backend=backend)


def local_moe(
    x_TD,
    weights_TK,
    experts_TK,
    gate_EID,
    up_EID,
    down_EDI,
    limit: float | None,
    *,
    policy: ExecutionPolicy,
    shared: SharedExpert | None = None,
):
    """All experts on this device, plus the shared expert when given: `grouped_local_moe` (on token chunks whose
    T x top_k rows fit in ROW_BUFFER_BYTES), except that on a GPU
    up to ROW_PATH_MAX_ROWS token-expert rows go through the row-by-row decode kernels instead, which also run
    the shared expert (one more row per token) when it has the routed experts' width. Quantised weights (routed
    or shared) as the kernels' ops take them: on a GPU the fused path reads them as stored (weight-only, or W8A8
    under a W8A8 scope: `runs_w8a8`, which also keeps every call off the row path); the row path reads block-FP8
    experts as stored and dequantises only the picked MXFP4 ones."""
    backend = resolve_backend(policy.kernel_backend)
    tokens, top_k = experts_TK.shape
    row_path = (
        _runs_gpu_kernels(backend) and tokens * top_k <= ROW_PATH_MAX_ROWS and not runs_w8a8(gate_EID, up_EID, down_EDI)
    )
    if row_path and shared is not None and shared.gate_ID.shape == gate_EID.shape[1:]:
        with jax.named_scope("routed_and_shared_experts"):
            return routed_experts(
                x_TD,
                weights_TK,
                experts_TK,
                gate_EID,
                up_EID,
                down_EDI,
                limit,
                backend=backend,
                shared=shared[:3],
                shared_limit=shared.limit,
            )
    with jax.named_scope("routed_experts"):
        if row_path:
            routed_TD = routed_experts(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, limit, backend=backend)
        else:
            grouped = functools.partial(
                grouped_local_moe, gate_EID=gate_EID, up_EID=up_EID, down_EDI=down_EDI, limit=limit, backend=backend
            )
            chunks = token_chunks(tokens, top_k, x_TD.shape[1] * x_TD.dtype.itemsize)
            routed_TD = in_token_chunks(grouped, chunks, x_TD, weights_TK, experts_TK)
    if shared is None:
        return routed_TD
    with jax.named_scope("shared_expert"):
        shared_TD = swiglu_ffn(x_TD, *shared, policy)
    return routed_TD + shared_TD
