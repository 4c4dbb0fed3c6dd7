"""The routed experts' maths around the kernels: the shared expert and its sum, the token chunks of a large step,
the SwiGLU MLP (the dense MLP and the shared expert) and the one-hot dense baseline.

Which kernels run the routed experts is chosen in one place, `pallas_kernels.moe.ops.expert_path` (by the kernel
backend, the rows of the call, the experts' format and the policy's FP8 mode), and `pallas_kernels.moe.ops.
moe_experts` runs them: on a GPU the row-by-row decode kernels for a few rows, else the two fused kernels (rows read
from the unsorted activations through the sort permutation and written back through it); W8A8 kernels for
block-FP8 experts under `ExecutionPolicy(fp8_matmul="w8a8")`, and under "auto" for a prefill-sized call on a GPU;
elsewhere three grouped matmuls over rows sorted by expert. Quantised experts (`ling_jax.quantized`, block FP8 or
MXFP4, stacked [E, ...] with per-expert scales) go to the kernels as stored.

A step whose [rows, hidden] buffers would exceed ROW_BUFFER_BYTES (a large prefill chunk) runs the routed experts
on its tokens in chunks, one after another (`token_chunks`, `in_token_chunks`; expert-parallel, see
`ling_jax.moe.expert_parallel`), every row computed as in one piece.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ling_jax.layers import linear_many, project
from ling_jax.policy import ExecutionPolicy
from ling_jax.quantized import dequantized
from pallas_kernels.moe.ops import ExpertWeights, Routing, expert_path, moe_experts
from pallas_kernels.moe.reference import swiglu

# A step whose [rows, hidden] buffers of the routed experts (per device) would exceed this many bytes runs them on
# its tokens in chunks, one after another (`token_chunks`, `in_token_chunks`): a large prefill chunk.
ROW_BUFFER_BYTES = 1 << 30


@functools.partial(jax.tree_util.register_dataclass, data_fields=["gate_ID", "up_ID", "down_DI"], meta_fields=["limit"])
@dataclasses.dataclass(frozen=True)
class SharedExpert:
    """The MoE's shared expert: SwiGLU weights in the checkpoint's [out, in] layout (arrays or quantised weights)
    and its clip (static)."""

    gate_ID: jax.Array
    up_ID: jax.Array
    down_DI: jax.Array
    limit: float | None

    @property
    def weights(self) -> tuple:
        return self.gate_ID, self.up_ID, self.down_DI


def swiglu_ffn(x, gate_ID, up_ID, down_DI, limit: float | None, policy: ExecutionPolicy | None = None) -> jax.Array:
    """down(swiglu(gate(x), up(x), limit)), each product a `project` (the weights cast or dequantised to x's dtype,
    or the FP8 kernels as the policy says; gate and up through `linear_many`: block-FP8 ones in one grouped gemv at
    decode sizes on a GPU): the dense MLP and shared expert."""
    gate, up = linear_many([{"weight": gate_ID}, {"weight": up_ID}], x, policy)
    return project(swiglu(gate, up, limit), down_DI, policy)


def expert_load(experts_TK, num_experts: int) -> jax.Array:
    """[E] float32: how many token-assignments each expert received (for balancing and reports)."""
    return jnp.zeros((num_experts,), jnp.float32).at[experts_TK.reshape(-1)].add(1.0)


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


def dense_expert_ffn(x_TD, routing: Routing, experts: ExpertWeights, limit: float | None):
    """The one-hot baseline: every expert sees every token and the routing weights zero out the rest.

    Exact and simple, E / top_k times the work of the grouped path; kept as the benchmark baseline and as an
    independent check of the grouped and expert-parallel paths.
    """
    dtype = x_TD.dtype
    combine_TE = jnp.zeros((x_TD.shape[0], experts.num_experts), jnp.float32)
    combine_TE = combine_TE.at[jnp.arange(x_TD.shape[0])[:, None], routing.experts_TK].add(routing.weights_TK)
    gate_EID, up_EID, down_EDI = (dequantized(w, dtype) for w in experts.stacks)
    gate = jnp.einsum("td,eid->tei", x_TD, gate_EID)
    up = jnp.einsum("td,eid->tei", x_TD, up_EID)
    y_TED = jnp.einsum("tei,edi->ted", swiglu(gate, up, limit), down_EDI)
    return jnp.einsum("ted,te->td", y_TED.astype(jnp.float32), combine_TE).astype(dtype)


def local_moe(
    x_TD,
    routing: Routing,
    experts: ExpertWeights,
    limit: float | None,
    *,
    policy: ExecutionPolicy,
    shared: SharedExpert | None = None,
    split_sums: bool = False,
):
    """All experts on this device, plus the shared expert when given: `moe_experts` on the kernels `expert_path`
    picks for the policy's backend and FP8 mode and the call's T x top_k rows, on token chunks whose rows fit in
    ROW_BUFFER_BYTES. The shared expert is added here (`swiglu_ffn`, as the policy says), unless the row kernels
    run it (`ExpertPath.with_shared`). split_sums: the output as [S, T, D] partial sums (the row kernels' splits,
    else one)."""
    tokens, top_k = routing.experts_TK.shape
    shared_weights = None if shared is None else shared.weights
    path = expert_path(policy.kernel_backend, experts, policy.fp8_matmul, rows=tokens * top_k, shared=shared_weights)
    if path.with_shared:
        with jax.named_scope("routed_and_shared_experts"):
            shared_args = {"shared": shared_weights, "shared_limit": shared.limit, "split_sums": split_sums}
            return moe_experts(x_TD, routing, experts, limit, path, **shared_args)
    if split_sums:
        return local_moe(x_TD, routing, experts, limit, policy=policy, shared=shared)[None]
    with jax.named_scope("routed_experts"):
        chunks = token_chunks(tokens, top_k, x_TD.shape[1] * x_TD.dtype.itemsize)
        routed_TD = in_token_chunks(
            lambda x, w, e: moe_experts(x, Routing(w, e), experts, limit, path),
            chunks,
            x_TD,
            routing.weights_TK,
            routing.experts_TK,
        )
    if shared is None:
        return routed_TD
    with jax.named_scope("shared_expert"):
        shared_TD = swiglu_ffn(x_TD, *shared.weights, shared.limit, policy)
    return routed_TD + shared_TD
