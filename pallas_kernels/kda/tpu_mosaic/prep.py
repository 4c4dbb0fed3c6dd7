"""Layout of the TPU KDA prefill kernels: heads flattened into the batch, T padded to whole chunks, and the
per-chunk gate inputs of the chunk step built once (`bounded_gates` for `chunk_math.chunk_step`, `any_gates`
for `exact_decay.chunk_step_any_gate`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.kda.chunk_math import SUB


@dataclasses.dataclass(frozen=True)
class ChunkInputs:
    q: jax.Array  # [BH, Tp, K]
    k: jax.Array  # [BH, Tp, K]
    v: jax.Array  # [BH, Tp, V]
    gates: tuple[jax.Array, ...]  # the chunk step's gate arguments: [BH, Tp, K] rows or [BH, N, a, b] per chunk
    beta: jax.Array  # [BH, Tp, 1] fp32
    state: jax.Array  # [BH, K, V] fp32


def bounded_gates(g_BNCK):
    """(g_cum [BH, Tp, K] cumulative within each chunk, its first and last rows [BH, N, 1, K], decay_last
    [BH, N, K, 1] = e^{g_last}) from the gates as chunks [BH, N, SUB, K] fp32."""
    g_cum = jnp.cumsum(g_BNCK, axis=2)
    g_last = g_cum[:, :, SUB - 1 :]
    decay_last = jnp.swapaxes(jnp.exp(g_last), -1, -2)
    return g_cum.reshape(g_BNCK.shape[0], -1, g_BNCK.shape[-1]), g_cum[:, :, :1], g_last, decay_last


def any_gates(g_BNCK):
    """(g [BH, Tp, K] as given, decay_last [BH, N, K, 1] = e^{sum of the chunk's gates})."""
    decay_last = jnp.swapaxes(jnp.exp(jnp.sum(g_BNCK, axis=2, keepdims=True)), -1, -2)
    return g_BNCK.reshape(g_BNCK.shape[0], -1, g_BNCK.shape[-1]), decay_last


def prepare(q, k, v, g, beta, initial_state, gate_inputs) -> ChunkInputs:
    """The kernel's inputs; gate_inputs: `bounded_gates` or `any_gates`."""
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    pad = -length % SUB  # padded tokens have g = 0 and beta = 0: an identity update

    def flat(x):  # [B, T, H, ...] -> [B*H, Tp, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x, 2, 1).reshape(batch * heads, length + pad, *x.shape[3:])

    if initial_state is None:
        initial_state = jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32)
    return ChunkInputs(
        q=flat(q),
        k=flat(k),
        v=flat(v),
        gates=gate_inputs(flat(g.astype(jnp.float32)).reshape(batch * heads, -1, SUB, key_dim)),
        beta=flat(beta.astype(jnp.float32)[..., None]),
        state=initial_state.astype(jnp.float32).reshape(batch * heads, key_dim, value_dim),
    )


def finish(o_flat, state_flat, batch, length, heads):
    """[BH, Tp, V] -> [B, T, H, V] and [BH, K, V] -> [B, H, K, V]."""
    o = jnp.moveaxis(o_flat.reshape(batch, heads, -1, o_flat.shape[-1]), 1, 2)[:, :length]
    return o, state_flat.reshape(batch, heads, *state_flat.shape[1:])
