"""KDA decode step on Hopper: a Pallas Mosaic GPU kernel moving the state with TMA.

The same update as the Triton kernel (`decode_gpu.py`): for each sequence-head, S <- diag(e^g) S;
S <- S + k beta (v - S^T k)^T; o = S^T q. One CTA of one warpgroup per (sequence-head, value block): five bulk
TMA copies bring the state slice [K, block_v] fp32 and the head's q, k, g, v rows into shared memory under one
barrier, the update runs in registers (wgmma's register layout, the sums over K are cross-warp reductions),
the new slice goes back to shared memory and out by TMA. With ~33 KiB of shared memory a CTA (block_v 64),
six CTAs share an SM, so one CTA's copies overlap the others' arithmetic.

The new state is a new array: `plgpu.kernel` has no input/output aliasing (the Triton kernel writes in
place); the traffic is the same, and under the model's jit the old buffer is free once the step has run.
K must be a multiple of 64 (the register layout's row tile), block_v a multiple of 8.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.compat import mosaic_gpu_interpret
from pallas_kernels.kda.reference import L2_EPS

LOADS = 5  # TMA copies under the one barrier: state slice, q, k, g, v


def _keep_layout(x, layout):
    """Interpret mode's stand-in for plgpu.layout_cast (register layouts do not exist there)."""
    del layout
    return x


def _normalized(x_K, use_qk_l2norm: bool):
    return x_K * lax.rsqrt((x_K * x_K).sum() + L2_EPS) if use_qk_l2norm else x_K


def _kernel(q_gmem, k_gmem, v_gmem, g_gmem, beta_gmem, state_gmem, o_gmem, new_state_gmem, state_smem, rows_smem,
            v_smem, o_smem, loaded, *, scale: float, use_qk_l2norm: bool, block_v: int, interpret: bool):
    head, block = lax.axis_index("head"), lax.axis_index("value_block")
    cols = pl.ds(block * block_v, block_v)
    for source, target in ((state_gmem.at[head, :, cols], state_smem), (q_gmem.at[head], rows_smem.at[0]),
                           (k_gmem.at[head], rows_smem.at[1]), (g_gmem.at[head], rows_smem.at[2]),
                           (v_gmem.at[head, cols], v_smem)):
        plgpu.copy_gmem_to_smem(source, target, loaded.at[0])
    plgpu.barrier_wait(loaded.at[0])
    cast = _keep_layout if interpret else plgpu.layout_cast
    along_k, along_v = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    q_K = _normalized(cast(rows_smem[0], along_k), use_qk_l2norm)
    k_K = _normalized(cast(rows_smem[1], along_k), use_qk_l2norm)
    decay_K = jnp.exp(cast(rows_smem[2], along_k))
    state_KV = cast(state_smem[...], plgpu.Layout.WGMMA)
    by_k = lambda x_K: lax.broadcast_in_dim(x_K, state_KV.shape, [0])  # noqa: E731
    state_KV = state_KV * by_k(decay_K)
    delta_V = beta_gmem[head] * (cast(v_smem[...], along_v) - (state_KV * by_k(k_K)).sum(axis=0))
    state_KV = state_KV + by_k(k_K) * lax.broadcast_in_dim(delta_V, state_KV.shape, [1])
    state_smem[...] = state_KV
    o_smem[...] = (state_KV * by_k(q_K * scale)).sum(axis=0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(state_smem, new_state_gmem.at[head, :, cols])
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[head, cols])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "block_v", "interpret"))
def kda_decode_step_mgpu(q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, state_BHKV, *, scale: float,
                         use_qk_l2norm: bool = True, block_v: int = 64, interpret: bool = False):
    """(o [B, H, V] in v's dtype, new state [B, H, K, V] fp32)."""
    batch, heads, key_dim = q_BHK.shape
    value_dim = v_BHV.shape[-1]
    block_v = min(block_v, value_dim)
    if key_dim % 64 or block_v % 8 or value_dim % block_v:
        raise ValueError(f"kda_decode_step_mgpu needs K a multiple of 64 and block_v a multiple of 8 dividing V; "
                         f"got K {key_dim}, V {value_dim}, block_v {block_v}")
    flat = batch * heads
    q, k, g = (x.reshape(flat, key_dim).astype(jnp.float32) for x in (q_BHK, k_BHK, g_BHK))
    v, beta = v_BHV.reshape(flat, value_dim).astype(jnp.float32), beta_BH.reshape(flat).astype(jnp.float32)
    kernel = functools.partial(_kernel, scale=scale, use_qk_l2norm=use_qk_l2norm, block_v=block_v,
                               interpret=interpret)
    o, state = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((flat, value_dim), jnp.float32),
                  jax.ShapeDtypeStruct((flat, key_dim, value_dim), jnp.float32)),
        scratch_types=(plgpu.SMEM((key_dim, block_v), jnp.float32), plgpu.SMEM((3, key_dim), jnp.float32),
                       plgpu.SMEM((block_v,), jnp.float32), plgpu.SMEM((block_v,), jnp.float32),
                       plgpu.Barrier(num_arrivals=LOADS, num_barriers=1)),
        grid=(flat, value_dim // block_v),
        grid_names=("head", "value_block"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=mosaic_gpu_interpret(interpret),
    )(q, k, v, g, beta, state_BHKV.reshape(flat, key_dim, value_dim).astype(jnp.float32))
    return (o.reshape(batch, heads, value_dim).astype(v_BHV.dtype),
            state.reshape(batch, heads, key_dim, value_dim))
