"""KDA chunked prefill on GPU: a Pallas kernel (Triton lowering).

Program (value block, sequence-head) walks the sequence in SUB-token chunks, keeping its [K, block_v] slice
of the fp32 state in registers, and applies `chunk_math.chunk_step` per chunk (tf32 tensor-core products for
bf16 inputs, IEEE fp32 for fp32 inputs). The K-side work of a chunk (the triangular solve) is repeated per
value block; not yet tuned for speed (BENCHMARKS.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda.chunk_math import SUB, Dots, chunk_step
from pallas_kernels.kda.chunk_prep import finish, prepare
from pallas_kernels.kda.reference import L2_EPS

def _dots(allow_tf32: bool) -> Dots:
    """tf32 tensor-core products for bf16/fp16 inputs (whose own rounding is larger), IEEE fp32 for fp32."""
    return Dots(nn=functools.partial(plgpu.dot, allow_tf32=allow_tf32),
                nt=functools.partial(plgpu.dot, trans_b=True, allow_tf32=allow_tf32),
                tn=functools.partial(plgpu.dot, trans_a=True, allow_tf32=allow_tf32))


def _l2(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2_EPS)


def _kernel(q_ref, k_ref, v_ref, g_ref, first_ref, last_ref, decay_ref, beta_ref, state_ref, o_ref, state_out_ref,
            *, scale, use_qk_l2norm, num_chunks):
    dots = _dots(allow_tf32=q_ref.dtype != jnp.float32)

    def body(c, state):
        rows = pl.ds(c * SUB, SUB)
        q = q_ref[rows, :].astype(jnp.float32)
        k = k_ref[rows, :].astype(jnp.float32)
        if use_qk_l2norm:
            q, k = _l2(q), _l2(k)
        o, state = chunk_step(q * scale, k, v_ref[rows, :].astype(jnp.float32), g_ref[rows, :],
                              first_ref[c], last_ref[c], decay_ref[c], beta_ref[rows, :], state, dots)
        o_ref[rows, :] = o.astype(o_ref.dtype)
        return state

    state_out_ref[...] = jax.lax.fori_loop(0, num_chunks, body, state_ref[...])


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "block_v", "num_warps", "interpret"))
def chunk_kda_gpu(q, k, v, g, beta, initial_state=None, *, scale: float, use_qk_l2norm: bool = True,
                  block_v: int = 64, num_warps: int = 8, interpret: bool = False):
    """(o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32)."""
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    block_v = min(block_v, value_dim)
    x = prepare(q, k, v, g, beta, initial_state)
    flat, padded, num_chunks = x.q.shape[0], x.q.shape[1], x.q.shape[1] // SUB
    whole = lambda width: pl.BlockSpec((None, padded, width), lambda j, i: (i, 0, 0))  # noqa: E731
    value_part = pl.BlockSpec((None, padded, block_v), lambda j, i: (i, 0, j))
    per_chunk = lambda a, b: pl.BlockSpec((None, num_chunks, a, b), lambda j, i: (i, 0, 0, 0))  # noqa: E731
    state_part = pl.BlockSpec((None, key_dim, block_v), lambda j, i: (i, 0, j))
    kernel = functools.partial(_kernel, scale=scale, use_qk_l2norm=use_qk_l2norm, num_chunks=num_chunks)
    o, state = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(value_dim, block_v), flat),
        in_specs=[whole(key_dim), whole(key_dim), value_part, whole(key_dim), per_chunk(1, key_dim),
                  per_chunk(1, key_dim), per_chunk(key_dim, 1), whole(1), state_part],
        out_specs=[value_part, state_part],
        out_shape=[jax.ShapeDtypeStruct((flat, padded, value_dim), v.dtype),
                   jax.ShapeDtypeStruct((flat, key_dim, value_dim), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_chunk_prefill",
    )(x.q, x.k, x.v, x.g_cum, x.g_first, x.g_last, x.decay_last, x.beta, x.state)
    return finish(o, state, batch, length, heads)
