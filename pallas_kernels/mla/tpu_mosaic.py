"""Absorbed-MLA decode on TPU: a Pallas Mosaic kernel, flash-decoding over sequence splits.

Grid (batch, split, block): the block axis walks one split of a sequence's latent cache in `block_k`-slot
tiles, accumulating the online softmax in VMEM scratch; splits are independent ("parallel", so both cores
of a megacore chip work on one sequence) and merged exactly by `combine_splits`. The cache length per
sequence is scalar-prefetched: tiles past it are neither computed nor fetched (the index map clamps to
the last useful tile, so the pipeline re-uses the buffer instead of issuing a DMA).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.mla import tuned
from pallas_kernels.mla.reference import combine_splits
from pallas_kernels.tuning import lookup

NEG_INF = -1e30


def _split_kernel(
    lengths_ref,
    q_latent_ref,
    q_rope_ref,
    kv_ref,
    o_ref,
    lse_ref,
    acc_ref,
    m_ref,
    l_ref,
    *,
    scale: float,
    block_k: int,
    blocks_per_split: int,
    latent_dim: int,
):
    b, split, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = lengths_ref[b]
    first = (split * blocks_per_split + block) * block_k

    @pl.when(block == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        m_ref[...] = jnp.full_like(m_ref, NEG_INF)
        l_ref[...] = jnp.zeros_like(l_ref)

    @pl.when(first < length)
    def _accumulate():
        kv = kv_ref[...]  # [block_k, R + P]; rows past the cache end (a partial last tile) are garbage
        valid_K1 = first + jax.lax.broadcasted_iota(jnp.int32, (kv.shape[0], 1), 0) < length
        kv = jnp.where(valid_K1, kv, jnp.zeros_like(kv))
        k_latent, k_rope = kv[:, :latent_dim], kv[:, latent_dim:]
        contract = (((1,), (1,)), ((), ()))
        scores = jax.lax.dot_general(
            q_latent_ref[...], k_latent, contract, preferred_element_type=jnp.float32
        ) + jax.lax.dot_general(q_rope_ref[...], k_rope, contract, preferred_element_type=jnp.float32)
        slots = first + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        scores = jnp.where(slots < length, scores * scale, NEG_INF)  # [H, block_k]
        m_prev = m_ref[...]  # [H, 1]
        m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
        p = jnp.exp(scores - m_new)
        correction = jnp.exp(m_prev - m_new)
        l_ref[...] = l_ref[...] * correction + jnp.sum(p, axis=1, keepdims=True)
        acc_ref[...] = acc_ref[...] * correction + jnp.dot(
            p.astype(k_latent.dtype), k_latent, preferred_element_type=jnp.float32
        )
        m_ref[...] = m_new

    @pl.when(block == blocks_per_split - 1)
    def _finish():
        weight_sum = l_ref[...]
        seen = weight_sum > 0
        o_ref[...] = acc_ref[...] / jnp.where(seen, weight_sum, 1.0)
        lse_ref[...] = jnp.where(seen, m_ref[...] + jnp.log(jnp.where(seen, weight_sum, 1.0)), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def mla_decode_tpu(
    q_latent_BHR,
    q_rope_BHP,
    kv_cache_BLA,
    lengths_B,
    *,
    scale: float,
    tiles: tuned.DecodeTpuTiles | None = None,
    interpret: bool = False,
):
    """o_latent [B, H, R] fp32. block_k: cache slots per tile, a multiple of 16; any cache length works (a
    cache shorter than one tile is one tile, a partial last tile is masked). None: `tuned.DECODE_TPU`."""
    tiles = tiles or lookup(tuned.DECODE_TPU, dtype=kv_cache_BLA.dtype)
    block_k, num_splits = tiles.block_k, tiles.num_splits
    batch, heads, latent_dim = q_latent_BHR.shape
    rope_dim = q_rope_BHP.shape[-1]
    max_len, width = kv_cache_BLA.shape[1:]
    if block_k % 16:
        raise ValueError(f"block_k must be a multiple of 16, got {block_k}")
    block_k = min(block_k, max_len)
    total_blocks = pl.cdiv(max_len, block_k)
    num_splits = min(num_splits, total_blocks)
    blocks_per_split = pl.cdiv(total_blocks, num_splits)
    dtype = kv_cache_BLA.dtype

    def kv_index(b, s, j, lengths_ref):
        last_useful = jnp.maximum(pl.cdiv(lengths_ref[b], block_k) - 1, 0)
        return b, jnp.minimum(jnp.minimum(s * blocks_per_split + j, last_useful), total_blocks - 1), 0

    kernel = functools.partial(
        _split_kernel, scale=scale, block_k=block_k, blocks_per_split=blocks_per_split, latent_dim=latent_dim
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, num_splits, blocks_per_split),
        in_specs=[
            pl.BlockSpec((None, heads, latent_dim), lambda b, s, j, lengths_ref: (b, 0, 0)),
            pl.BlockSpec((None, heads, rope_dim), lambda b, s, j, lengths_ref: (b, 0, 0)),
            pl.BlockSpec((None, block_k, width), kv_index),
        ],
        out_specs=[
            pl.BlockSpec((None, None, heads, latent_dim), lambda b, s, j, lengths_ref: (b, s, 0, 0)),
            pl.BlockSpec((None, None, heads, 1), lambda b, s, j, lengths_ref: (b, s, 0, 0)),
        ],
        scratch_shapes=[
            pltpu.VMEM((heads, latent_dim), jnp.float32),
            pltpu.VMEM((heads, 1), jnp.float32),
            pltpu.VMEM((heads, 1), jnp.float32),
        ],
    )
    o_BSHR, lse_BSH1 = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_splits, heads, latent_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_splits, heads, 1), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="mla_decode_split",
    )(lengths_B.astype(jnp.int32), q_latent_BHR.astype(dtype), q_rope_BHP.astype(dtype), kv_cache_BLA)
    return combine_splits(o_BSHR, lse_BSH1[..., 0])
