"""The routed experts' arithmetic, independent of where they live: SwiGLU (with the optional clip), the
grouped FFN over rows sorted by expert, the weighted combine, and the one-hot dense baseline.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.backend import KERNEL_TARGET
from pallas_kernels.moe.ops import grouped_matmul, routed_experts
from pallas_kernels.moe.reference import swiglu

# Up to this many token-expert rows (8 tokens at top-8), a GPU runs the routed experts row by row
# (`pallas_kernels.moe.routed_experts`: no sort, each row streams its expert), above it the grouped path.
ROW_PATH_MAX_ROWS = 64


def expert_load(experts_TK, num_experts: int) -> jax.Array:
    """[E] float32: how many token-assignments each expert received (for balancing and reports)."""
    return jnp.zeros((num_experts,), jnp.float32).at[experts_TK.reshape(-1)].add(1.0)


def grouped_expert_ffn(x_RD, expert_R, gate_EID, up_EID, down_EDI, limit: float | None, *, backend: str):
    """SwiGLU experts applied row-wise: row r goes through expert expert_R[r] of the E given ones.

    Rows whose expert is outside [0, E) are skipped (their output is 0): the caller marks rows routed to
    other devices, or unused buffer slots, that way. Rows are sorted by expert, run through three grouped
    matmuls (`pallas_kernels.moe.grouped_matmul`), and put back in order.
    """
    num_experts = gate_EID.shape[0]
    key_R = jnp.where((expert_R >= 0) & (expert_R < num_experts), expert_R, num_experts)
    order_R = jnp.argsort(key_R, stable=True)
    sizes_E = jnp.zeros((num_experts + 1,), jnp.int32).at[key_R].add(1)[:num_experts]
    x_sorted = x_RD[order_R]
    dtype = x_RD.dtype
    hidden_RI = swiglu(grouped_matmul(x_sorted, gate_EID.astype(dtype), sizes_E, backend=backend),
                       grouped_matmul(x_sorted, up_EID.astype(dtype), sizes_E, backend=backend), limit)
    y_sorted = grouped_matmul(hidden_RI, down_EDI.astype(dtype), sizes_E, backend=backend)
    return jnp.zeros_like(y_sorted).at[order_R].set(y_sorted)


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
    gate = jnp.einsum("td,eid->tei", x_TD, gate_EID.astype(dtype))
    up = jnp.einsum("td,eid->tei", x_TD, up_EID.astype(dtype))
    y_TED = jnp.einsum("tei,edi->ted", swiglu(gate, up, limit), down_EDI.astype(dtype))
    return jnp.einsum("ted,te->td", y_TED.astype(jnp.float32), combine_TE).astype(dtype)


def grouped_local_moe(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, limit: float | None, *,
                      backend: str):
    """All experts on this device: each token's k assignments become k rows of one grouped FFN."""
    tokens, top_k = experts_TK.shape
    rows_D = jnp.repeat(x_TD, top_k, axis=0)
    y_RD = grouped_expert_ffn(rows_D, experts_TK.reshape(-1), gate_EID, up_EID, down_EDI, limit, backend=backend)
    return combine(y_RD.reshape(tokens, top_k, -1), weights_TK, x_TD.dtype)


def local_moe(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, limit: float | None, *, backend: str):
    """All experts on this device: `grouped_local_moe`, except that on a GPU up to ROW_PATH_MAX_ROWS
    token-expert rows go through the row-by-row decode kernels instead."""
    tokens, top_k = experts_TK.shape
    if KERNEL_TARGET.get(backend) == "gpu" and tokens * top_k <= ROW_PATH_MAX_ROWS:
        return routed_experts(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, limit, backend=backend)
    return grouped_local_moe(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, limit, backend=backend)
