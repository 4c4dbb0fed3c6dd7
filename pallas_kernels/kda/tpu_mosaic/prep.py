"""Layout of the TPU KDA prefill kernel: heads flattened into the batch, T padded to whole chunks, and
the per-chunk gate quantities (chunk-local cumsum, its first and last rows, e^last as a column) built once."""

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
    g_cum: jax.Array  # [BH, Tp, K] fp32, cumulative within each SUB-token chunk
    g_first: jax.Array  # [BH, N, 1, K]
    g_last: jax.Array  # [BH, N, 1, K]
    decay_last: jax.Array  # [BH, N, K, 1] = e^{g_last}
    beta: jax.Array  # [BH, Tp, 1] fp32
    state: jax.Array  # [BH, K, V] fp32


def prepare(q, k, v, g, beta, initial_state) -> ChunkInputs:
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    pad = -length % SUB  # padded tokens have g = 0 and beta = 0: an identity update

    def flat(x):  # [B, T, H, ...] -> [B*H, Tp, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x, 2, 1).reshape(batch * heads, length + pad, *x.shape[3:])

    g_chunks = flat(g.astype(jnp.float32)).reshape(batch * heads, -1, SUB, key_dim)
    g_cum = jnp.cumsum(g_chunks, axis=2)
    g_last = g_cum[:, :, SUB - 1 :]
    if initial_state is None:
        initial_state = jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32)
    return ChunkInputs(
        q=flat(q),
        k=flat(k),
        v=flat(v),
        g_cum=g_cum.reshape(batch * heads, -1, key_dim),
        g_first=g_cum[:, :, :1],
        g_last=g_last,
        decay_last=jnp.swapaxes(jnp.exp(g_last), -1, -2),
        beta=flat(beta.astype(jnp.float32)[..., None]),
        state=initial_state.astype(jnp.float32).reshape(batch * heads, key_dim, value_dim),
    )


def finish(o_flat, state_flat, batch, length, heads):
    """[BH, Tp, V] -> [B, T, H, V] and [BH, K, V] -> [B, H, K, V]."""
    o = jnp.moveaxis(o_flat.reshape(batch, heads, -1, o_flat.shape[-1]), 1, 2)[:, :length]
    return o, state_flat.reshape(batch, heads, *state_flat.shape[1:])
