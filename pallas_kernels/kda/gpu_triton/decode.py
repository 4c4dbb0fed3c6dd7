"""KDA decode step on GPU: a Pallas kernel (Triton lowering) streaming the recurrent state once.

Program (value block, sequence-head) updates the [K, block_v] slice of that head's fp32 state:
S <- diag(e^g) S; S <- S + k beta (v - S^T k)^T; o = S^T q, written back over the input (aliased). The step
is bound by state traffic: 2 x 4 bytes x K x V per head, read and written once.

One sequence-head and one value block per program, the whole [K, block_v] slice loaded at once (K-chunked
two-pass updates with a register prefetch, several sequence-heads per program, persistent programs and an
out-of-place state were measured slower or no faster and removed: docs/benchmarks, KDA decode step). q, k and g
carry an L2 evict-last hint (every value block of the head reads them), v and o evict-first, as fla's kernel does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda import tuned
from pallas_kernels.kda.reference import L2_EPS
from pallas_kernels.kda.step_math import delta_rule_update
from pallas_kernels.tuning import lookup


def _inverse_norm(x_K, use_qk_l2norm):
    """1 / ||x||_2 (eps-guarded), or 1 when the inputs are used as given."""
    return jax.lax.rsqrt(jnp.sum(x_K * x_K) + L2_EPS) if use_qk_l2norm else 1.0


def _normalized(x_ref, use_qk_l2norm):
    """x_ref's row in fp32, L2-normalised when asked (kept in L2: the head's other value blocks read it too)."""
    x_K = plgpu.load(x_ref, eviction_policy="evict_last").astype(jnp.float32)
    return x_K * _inverse_norm(x_K, use_qk_l2norm)


def _step_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, state_ref, o_ref, new_state_ref, *, scale, use_qk_l2norm):
    """One sequence-head's update of its [K, bv] state slice."""
    state_KV = state_ref[...]
    q_K, k_K = _normalized(q_ref, use_qk_l2norm), _normalized(k_ref, use_qk_l2norm)
    state_KV = state_KV * jnp.exp(plgpu.load(g_ref, eviction_policy="evict_last"))[:, None]
    v_V = plgpu.load(v_ref, eviction_policy="evict_first").astype(jnp.float32)
    state_KV = delta_rule_update(state_KV, k_K, v_V, beta_ref[...])
    new_state_ref[...] = state_KV
    plgpu.store(
        o_ref, jnp.sum((q_K * scale)[:, None] * state_KV, axis=0).astype(o_ref.dtype), eviction_policy="evict_first"
    )


@functools.partial(
    jax.jit,
    static_argnames=("scale", "use_qk_l2norm", "tiles", "interpret"),
    donate_argnames=("state_BHKV",),
)
def kda_decode_step_gpu(
    q_BHK,
    k_BHK,
    v_BHV,
    g_BHK,
    beta_BH,
    state_BHKV,
    *,
    scale: float,
    use_qk_l2norm: bool = True,
    tiles: tuned.DecodeGpuTiles | None = None,
    interpret: bool = False,
):
    """(o [B, H, V] in v's dtype, new state [B, H, K, V] fp32, written in place of the donated state).
    Tiles: None from `tuned.DECODE_GPU`."""
    tiles = tiles or lookup(tuned.DECODE_GPU, dtype=v_BHV.dtype)
    batch, heads, key_dim = q_BHK.shape
    value_dim = v_BHV.shape[-1]
    block_v = min(tiles.block_v, value_dim)
    flat = batch * heads
    q, k, g = (x.reshape(flat, key_dim) for x in (q_BHK, k_BHK, g_BHK))
    v, beta = v_BHV.reshape(flat, value_dim), beta_BH.reshape(flat)
    state = state_BHKV.reshape(flat, key_dim, value_dim)
    row = pl.BlockSpec((None, key_dim), lambda j, i: (i, 0))
    value_block = pl.BlockSpec((None, block_v), lambda j, i: (i, j))
    state_block = pl.BlockSpec((None, key_dim, block_v), lambda j, i: (i, 0, j))
    o, state = pl.pallas_call(
        functools.partial(_step_kernel, scale=scale, use_qk_l2norm=use_qk_l2norm),
        grid=(pl.cdiv(value_dim, block_v), flat),
        in_specs=[row, row, value_block, row, pl.BlockSpec((None,), lambda j, i: (i,)), state_block],
        out_specs=[value_block, state_block],
        out_shape=[
            jax.ShapeDtypeStruct((flat, value_dim), v_BHV.dtype),
            jax.ShapeDtypeStruct((flat, key_dim, value_dim), jnp.float32),
        ],
        input_output_aliases={5: 1},
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret,
        name="kda_decode_step",
    )(q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32), state.astype(jnp.float32))
    return o.reshape(batch, heads, value_dim), state.reshape(batch, heads, key_dim, value_dim)
