"""KDA decode step on Hopper: a Pallas Mosaic GPU kernel that streams the fp32 state through shared memory.

The step reads and writes each head's [K, V] fp32 state once and is bound by that traffic. Persistent CTAs
(one an SM) walk their share of the [K, block_v] state tiles with two warpgroups:

- the producer keeps `stages` tiles in flight: TMA loads of the state tile and the head's q, k, g rows, the
  tile's v block and beta, into a ring of shared-memory buffers, refilling a buffer once it is released;
- the consumer reads a tile's inputs into registers and releases the buffer at once, then S <- diag(e^g) S;
  S <- S + k beta (v - S^T k)^T; o = S^T q (q and k L2-normalised when asked, q scaled), and stores S and o
  with TMA from its output buffers, so loads, updates and stores of different tiles overlap.

One consumer: the sums over K cross warps, and Mosaic GPU's cross-warp reductions share one shared-memory
scratch per CTA, so two consumers reducing at once race on it (they did: NaNs on the H200).

The new state is a separate output (Pallas Mosaic GPU kernels do not alias inputs); under `jax.jit` the
donated input buffer is freed after the step.
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

CONSUMERS = 1
BETA_CHUNK = 32  # beta is read 128 bytes at a time: every buffer of the ring starts 128-byte aligned, as TMA needs


def _state_layout(block_v: int):
    """State tiles in shared memory: 8-row tiles, swizzled (rows 4 * block_v bytes apart would otherwise put
    the rows a warp reads in the same banks)."""
    swizzle = min(128, 4 * block_v)
    return plgpu.TilingTransform((8, swizzle // 4)), plgpu.SwizzleTransform(swizzle)


def _keep_layout(x, layout):
    """Interpret mode's stand-in for plgpu.layout_cast (register layouts do not exist there)."""
    del layout
    return x


def _producer(first_tile, num_tiles, tile_stride, gmem, smem, ready, free, *, tiles_per_head: int, block_v: int,
              stages: int):
    q_gmem, k_gmem, g_gmem, v_gmem, beta_gmem, state_gmem = gmem

    def load(i, slot):
        tile = first_tile + i * tile_stride
        head, v_block = lax.div(tile, tiles_per_head), lax.rem(tile, tiles_per_head)
        cols = pl.ds(v_block * block_v, block_v)
        sources = (q_gmem.at[head], k_gmem.at[head], g_gmem.at[head], v_gmem.at[head, cols],
                   beta_gmem.at[pl.ds(lax.div(head, BETA_CHUNK) * BETA_CHUNK, BETA_CHUNK)],
                   state_gmem.at[head, :, cols])
        for source, buffer in zip(sources, smem):
            plgpu.copy_gmem_to_smem(source, buffer.at[slot], ready.at[slot])

    for i in range(stages):
        pl.when(i < num_tiles)(functools.partial(load, i, i))

    @pl.loop(stages, jnp.maximum(num_tiles, stages))
    def _refill(i):
        slot = lax.rem(i, stages)
        plgpu.barrier_wait(free.at[slot])
        load(i, slot)

    @pl.loop(jnp.maximum(num_tiles - stages, 0), num_tiles)
    def _drain(i):  # every release is observed before the barriers go away
        plgpu.barrier_wait(free.at[lax.rem(i, stages)])


def _column_sums(x_KV):
    return jnp.sum(x_KV, axis=0)


def _updated(state_KV, q_K, k_K, g_K, v_V, beta, *, scale: float, use_qk_l2norm: bool):
    """(o [bv], new state [K, bv]) in fp32; every product is formed on the [K, bv] tile (its column sums are
    the reductions over K), so no 1-D reduction is needed."""
    shape = state_KV.shape

    def rows(x_K):
        return lax.broadcast_in_dim(x_K, shape, [0])

    def cols(x_V):
        return lax.broadcast_in_dim(x_V, shape, [1])

    q_KV, k_KV = rows(q_K), rows(k_K)
    state_KV = state_KV * rows(jnp.exp(g_K))
    if use_qk_l2norm:
        inv_k_V = lax.rsqrt(_column_sums(k_KV * k_KV) + L2_EPS)
        inv_q_V = lax.rsqrt(_column_sums(q_KV * q_KV) + L2_EPS) * scale
    else:
        inv_k_V, inv_q_V = jnp.full((shape[1],), 1.0, jnp.float32), jnp.full((shape[1],), scale, jnp.float32)
    delta_V = beta * (v_V - _column_sums(k_KV * state_KV) * inv_k_V)
    state_KV = state_KV + k_KV * cols(delta_V * inv_k_V)
    return _column_sums(q_KV * state_KV) * inv_q_V, state_KV


def _consumer(consumer: int, first_tile, num_tiles, tile_stride, smem, out_smem, o_smem, o_gmem, state_out_gmem,
              ready, free, *, tiles_per_head: int, block_v: int, stages: int, scale: float, use_qk_l2norm: bool,
              interpret: bool):
    """Tiles i = consumer, consumer + CONSUMERS, ... of this CTA's share; the state tile in registers in the
    wgmma accumulator layout, the [K] vectors in its row layout, the [bv] ones in its column layout."""
    cast = _keep_layout if interpret else plgpu.layout_cast
    q_smem, k_smem, g_smem, v_smem, beta_smem, state_smem = smem

    @pl.loop(consumer, num_tiles, step=CONSUMERS)
    def _tile(i):
        slot = lax.rem(i, stages)
        tile = first_tile + i * tile_stride
        head, v_block = lax.div(tile, tiles_per_head), lax.rem(tile, tiles_per_head)
        plgpu.barrier_wait(ready.at[slot])
        rows, cols = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)  # [K] and [bv] vectors
        inputs = (cast(state_smem.at[slot][...], plgpu.Layout.WGMMA),
                  *(cast(x_smem.at[slot][...], rows).astype(jnp.float32) for x_smem in (q_smem, k_smem, g_smem)),
                  cast(v_smem.at[slot][...], cols).astype(jnp.float32), beta_smem[slot, lax.rem(head, BETA_CHUNK)])
        plgpu.barrier_arrive(free.at[slot])  # the inputs are in registers: the producer may refill the buffer
        o_V, state_KV = _updated(*inputs, scale=scale, use_qk_l2norm=use_qk_l2norm)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this consumer's previous stores have read its buffers
        out_smem.at[consumer][...] = state_KV
        o_smem.at[consumer][...] = o_V.astype(o_smem.dtype)
        plgpu.commit_smem()
        cols = pl.ds(v_block * block_v, block_v)
        plgpu.copy_smem_to_gmem(out_smem.at[consumer], state_out_gmem.at[head, :, cols])
        plgpu.copy_smem_to_gmem(o_smem.at[consumer], o_gmem.at[head, cols])

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _kernel(q_gmem, k_gmem, g_gmem, v_gmem, beta_gmem, state_gmem, o_gmem, state_out_gmem, q_smem, k_smem, g_smem,
            v_smem, beta_smem, state_smem, out_smem, o_smem, ready, free, *, num_ctas: int, total_tiles: int,
            **params):
    cta, warpgroup = lax.axis_index("cta"), lax.axis_index("wg")
    num_tiles = lax.div(total_tiles - cta + num_ctas - 1, num_ctas)  # tiles cta, cta + num_ctas, ...
    smem = (q_smem, k_smem, g_smem, v_smem, beta_smem, state_smem)
    for consumer in range(CONSUMERS):
        pl.when(warpgroup == consumer)(functools.partial(
            _consumer, consumer, cta, num_tiles, num_ctas, smem, out_smem, o_smem, o_gmem, state_out_gmem, ready, free,
            **params))
    producer_params = {name: params[name] for name in ("tiles_per_head", "block_v", "stages")}
    pl.when(warpgroup == CONSUMERS)(functools.partial(
        _producer, cta, num_tiles, num_ctas, (q_gmem, k_gmem, g_gmem, v_gmem, beta_gmem, state_gmem), smem, ready,
        free, **producer_params))


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "block_v", "stages", "ctas_per_sm",
                                             "num_ctas", "interpret"))
def kda_decode_step_mgpu(q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, state_BHKV, *, scale: float,
                         use_qk_l2norm: bool = True, block_v: int = 64, stages: int = 4, ctas_per_sm: int = 1,
                         num_ctas: int | None = None, interpret: bool = False):
    """(o [B, H, V] in v's dtype, new state [B, H, K, V] fp32). q, k, v bf16 or fp16; g fp32 log-decay; beta
    [B, H]; state fp32. num_ctas: persistent CTAs (default: ctas_per_sm times the GPU's SM count, 8 in
    interpret mode); two an SM need stages <= 2 (shared memory), each with its own consumer and scratch."""
    batch, heads, key_dim = q_BHK.shape
    value_dim = v_BHV.shape[-1]
    if key_dim % 64 or value_dim % block_v or block_v % 64 or stages < 1:
        raise ValueError(f"kda_decode_step_mgpu needs K a multiple of 64, V a multiple of block_v (a multiple of "
                         f"64: block_v 32 faulted with a misaligned address on an H200) and stages >= 1; got K "
                         f"{key_dim}, V {value_dim}, block_v {block_v}, stages {stages}")
    flat = batch * heads
    tiles_per_head = value_dim // block_v
    total_tiles = flat * tiles_per_head
    if num_ctas is None:
        num_ctas = 8 if interpret else ctas_per_sm * jax.devices()[0].core_count
    num_ctas = min(num_ctas, total_tiles)
    beta_F = jnp.pad(beta_BH.reshape(flat).astype(jnp.float32), (0, -flat % BETA_CHUNK))
    params = dict(tiles_per_head=tiles_per_head, block_v=block_v, stages=stages, scale=scale,
                  use_qk_l2norm=use_qk_l2norm, interpret=interpret)
    o, state = plgpu.kernel(
        functools.partial(_kernel, num_ctas=num_ctas, total_tiles=total_tiles, **params),
        out_type=(jax.ShapeDtypeStruct((flat, value_dim), v_BHV.dtype),
                  jax.ShapeDtypeStruct((flat, key_dim, value_dim), jnp.float32)),
        scratch_types=(
            plgpu.SMEM((stages, key_dim), q_BHK.dtype),
            plgpu.SMEM((stages, key_dim), k_BHK.dtype),
            plgpu.SMEM((stages, key_dim), jnp.float32),
            plgpu.SMEM((stages, block_v), v_BHV.dtype),
            plgpu.SMEM((stages, BETA_CHUNK), jnp.float32),
            plgpu.SMEM((stages, key_dim, block_v), jnp.float32, transforms=_state_layout(block_v)),
            plgpu.SMEM((CONSUMERS, key_dim, block_v), jnp.float32, transforms=_state_layout(block_v)),
            plgpu.SMEM((CONSUMERS, block_v), v_BHV.dtype),
            plgpu.Barrier(num_arrivals=6, num_barriers=stages),  # six copies fill a buffer
            plgpu.Barrier(num_barriers=stages),
        ),
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=mosaic_gpu_interpret(interpret),
    )(q_BHK.reshape(flat, key_dim), k_BHK.reshape(flat, key_dim), g_BHK.reshape(flat, key_dim).astype(jnp.float32),
      v_BHV.reshape(flat, value_dim), beta_F, state_BHKV.reshape(flat, key_dim, value_dim).astype(jnp.float32))
    return o.reshape(batch, heads, value_dim), state.reshape(batch, heads, key_dim, value_dim)
