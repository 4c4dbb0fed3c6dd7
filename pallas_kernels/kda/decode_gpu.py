"""KDA decode step on GPU: a Pallas kernel (Triton lowering) streaming the recurrent state once.

Program (value block, sequence-head) loads the [K, block_v] slice of one head's fp32 state, applies
S <- diag(e^g) S; S <- S + k beta (v - S^T k)^T; o = S^T q, and writes the slice back over the input
(aliased). The step is bound by state traffic: 2 x 4 bytes x K x V per head, read and write once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda.reference import L2_EPS


def _step_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, state_ref, o_ref, new_state_ref, *, scale, use_qk_l2norm):
    q = q_ref[...].astype(jnp.float32)  # [K]
    k = k_ref[...].astype(jnp.float32)
    if use_qk_l2norm:
        q = q * jax.lax.rsqrt(jnp.sum(q * q) + L2_EPS)
        k = k * jax.lax.rsqrt(jnp.sum(k * k) + L2_EPS)
    state = state_ref[...] * jnp.exp(g_ref[...].astype(jnp.float32))[:, None]  # [K, bv]
    delta = beta_ref[...].astype(jnp.float32) * (v_ref[...].astype(jnp.float32) - jnp.sum(k[:, None] * state, 0))
    state = state + k[:, None] * delta[None, :]
    new_state_ref[...] = state
    o_ref[...] = (jnp.sum((q * scale)[:, None] * state, axis=0)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "block_v", "num_warps", "interpret"),
                   donate_argnames=("state_BHKV",))
def kda_decode_step_gpu(q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, state_BHKV, *, scale: float, use_qk_l2norm: bool = True,
                        block_v: int = 64, num_warps: int = 4, interpret: bool = False):
    """(o [B, H, V] in v's dtype, new state [B, H, K, V] fp32, written in place of the donated state)."""
    batch, heads, key_dim = q_BHK.shape
    value_dim = v_BHV.shape[-1]
    block_v = min(block_v, value_dim)
    flat = batch * heads
    q, k, g = (x.reshape(flat, key_dim) for x in (q_BHK, k_BHK, g_BHK))
    v, beta = v_BHV.reshape(flat, value_dim), beta_BH.reshape(flat)
    state = state_BHKV.reshape(flat, key_dim, value_dim)
    kernel = functools.partial(_step_kernel, scale=scale, use_qk_l2norm=use_qk_l2norm)
    row = lambda j, i: (i, 0)  # noqa: E731
    o, state = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(value_dim, block_v), flat),
        in_specs=[pl.BlockSpec((None, key_dim), row), pl.BlockSpec((None, key_dim), row),
                  pl.BlockSpec((None, block_v), lambda j, i: (i, j)), pl.BlockSpec((None, key_dim), row),
                  pl.BlockSpec((None,), lambda j, i: (i,)),
                  pl.BlockSpec((None, key_dim, block_v), lambda j, i: (i, 0, j))],
        out_specs=[pl.BlockSpec((None, block_v), lambda j, i: (i, j)),
                   pl.BlockSpec((None, key_dim, block_v), lambda j, i: (i, 0, j))],
        out_shape=[jax.ShapeDtypeStruct((flat, value_dim), v_BHV.dtype),
                   jax.ShapeDtypeStruct((flat, key_dim, value_dim), jnp.float32)],
        input_output_aliases={5: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_decode_step",
    )(q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32), state.astype(jnp.float32))
    return o.reshape(batch, heads, value_dim), state.reshape(batch, heads, key_dim, value_dim)
