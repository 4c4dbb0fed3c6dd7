"""Absorbed-MLA decode on Hopper: a Pallas Mosaic GPU kernel (wgmma, TMA, a producer warpgroup).

One CTA per (sequence, split) serves all 64 heads at once (the attention is MQA, so every head reads the same
cache tile, and 64 is wgmma's M) and walks its split of the latent cache in tiles of `block_k` slots, with
three warpgroups:

- the producer loads the query [64, 576] once and streams cache tiles [block_k, 576] through a ring of
  `stages` shared-memory buffers with TMA, refilling a buffer as soon as both consumers release it;
- the scores consumer forms S = Q K^T over all 576 columns, runs the online softmax, hands P (bf16) and the
  per-head rescale factor to the other consumer through shared memory, and accumulates P·V for the first 256
  output latent columns;
- the values consumer accumulates P·V for the other 256 columns.

Each consumer keeps a [64, 256] fp32 accumulator (128 registers a thread; one warpgroup could not hold the
whole [64, 512]). No product is computed twice, and the scores consumer's S of tile t+1 overlaps the values
consumer's P·V of tile t. Shared memory: the query 72 KiB, two 64-slot cache tiles 144 KiB, P 8 KiB (wgmma
needs K = block_k to be a multiple of 64, so three stages do not fit the 227 KiB).

Each consumer writes its softmax-normalised half of the split's output and the scores consumer the split's
log-sum-exp; `combine_splits` merges the splits exactly (in XLA; the Triton kernel's splits are merged by a kernel,
`gpu_triton/decode.py`). The query and P go to the tensor cores in the cache dtype (bf16 or fp16) with fp32
accumulation.

The cache is contiguous ([B, L, 576], `mla_decode_mgpu`) or paged ([P, page_size, 576] with a page table,
`mla_decode_paged_mgpu`); only the producer's view of tile i differs. Tiles: None from `tuned.DECODE_MOSAIC`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mla import mosaic_parts, tuned
from pallas_kernels.mla.reference import combine_splits
from pallas_kernels.tuning import lookup

HEADS = 64  # wgmma's M; fewer heads are padded to it
CONSUMERS = 2


def _rescaled_plus_values(acc_chunks, correction_H, p_smem, values_smem, chunk_cols):
    """Each [64, chunk] accumulator times the per-head correction, plus P @ values[:, chunk] (a fresh wgmma
    accumulator per chunk: interpret mode has no in-place accumulation, and a chunk needs fewer registers)."""

    def plus_chunk(acc_HC, cols):
        values_HC = mosaic_parts.product(p_smem, values_smem.at[:, cols], *acc_HC.shape)
        return acc_HC * lax.broadcast_in_dim(correction_H, acc_HC.shape, [0]) + values_HC

    return tuple(plus_chunk(acc_HC, cols) for acc_HC, cols in zip(acc_chunks, chunk_cols))


def _store_normalised(o_gmem, acc_chunks, chunk_cols, l_H):
    l_safe_H = jnp.where(l_H > 0, l_H, 1.0)
    for acc_HC, cols in zip(acc_chunks, chunk_cols):
        o_gmem[:, cols] = acc_HC / lax.broadcast_in_dim(l_safe_H, acc_HC.shape, [0])


def _chunks(consumer: int, latent_dim: int, pv_chunk: int, cast):
    half = latent_dim // CONSUMERS
    cols = [pl.ds(consumer * half + c, pv_chunk) for c in range(0, half, pv_chunk)]
    return cols, tuple(cast(jnp.zeros((HEADS, pv_chunk), jnp.float32), plgpu.Layout.WGMMA) for _ in cols)


def _scores_consumer(
    length, first_slot, num_tiles, refs, *, scale: float, block_k: int, stages: int, pv_chunk: int, cast
):
    """Warpgroup 0: scores, online softmax, P and the correction to shared memory, P·V of the first half."""
    q_smem, kv_smem, p_smem, correction_smem, l_smem, barriers, o_gmem, lse_gmem = refs
    kv_ready, kv_free, q_ready, p_ready, p_free = barriers
    chunk_cols, acc_init = _chunks(0, o_gmem.shape[-1], pv_chunk, cast)
    plgpu.set_max_registers(232, action="increase")
    plgpu.barrier_wait(q_ready.at[0])

    def tile_step(t, carry):
        acc_chunks, m_H, l_H = carry
        slot = lax.rem(t, stages)
        plgpu.barrier_wait(kv_ready.at[slot])

        def scores(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, kv_smem.at[slot].transpose((1, 0)))  # K read K-major
            return acc_ref[...]

        scores_HK = pl.run_scoped(scores, plgpu.ACC((HEADS, block_k), jnp.float32))
        slot_HK = cast(lax.broadcasted_iota(jnp.int32, (HEADS, block_k), 1), plgpu.Layout.WGMMA)
        scores_HK = jnp.where(first_slot + t * block_k + slot_HK < length, scores_HK * scale, -jnp.inf)
        m_new = jnp.maximum(m_H, scores_HK.max(axis=1))
        correction_H = jnp.exp(m_H - m_new)
        p_HK = jnp.exp(scores_HK - lax.broadcast_in_dim(m_new, scores_HK.shape, [0]))
        l_H = l_H * correction_H + p_HK.sum(axis=1)
        pl.when(t > 0)(lambda: plgpu.barrier_wait(p_free.at[0]))  # the values consumer is done with P of t-1
        p_smem[...] = p_HK.astype(p_smem.dtype)
        correction_smem[...] = correction_H
        plgpu.commit_smem()
        plgpu.barrier_arrive(p_ready.at[0])
        acc_chunks = _rescaled_plus_values(acc_chunks, correction_H, p_smem, kv_smem.at[slot], chunk_cols)
        plgpu.barrier_arrive(kv_free.at[slot])
        return acc_chunks, m_new, l_H

    init = (
        acc_init,
        cast(jnp.full((HEADS,), -1e30, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        cast(jnp.zeros((HEADS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )
    acc_chunks, m_H, l_H = lax.fori_loop(0, num_tiles, tile_step, init)
    pl.when(num_tiles > 0)(lambda: plgpu.barrier_wait(p_free.at[0]))
    l_smem[...] = l_H
    plgpu.barrier_arrive(p_ready.at[0])  # one more phase: the softmax sums are final
    _store_normalised(o_gmem, acc_chunks, chunk_cols, l_H)
    lse_gmem[...] = jnp.where(l_H > 0, m_H + jnp.log(jnp.where(l_H > 0, l_H, 1.0)), -jnp.inf)


def _values_consumer(num_tiles, refs, *, stages: int, pv_chunk: int, cast):
    """Warpgroup 1: P·V of the second half of the output columns, with P and the correction from warpgroup 0."""
    _, kv_smem, p_smem, correction_smem, l_smem, barriers, o_gmem, _ = refs
    kv_ready, kv_free, _, p_ready, p_free = barriers
    chunk_cols, acc_init = _chunks(1, o_gmem.shape[-1], pv_chunk, cast)
    plgpu.set_max_registers(232, action="increase")

    def tile_step(t, acc_chunks):
        slot = lax.rem(t, stages)
        plgpu.barrier_wait(kv_ready.at[slot])
        plgpu.barrier_wait(p_ready.at[0])
        correction_H = cast(correction_smem[...], plgpu.Layout.WGMMA.reduce(1))
        acc_chunks = _rescaled_plus_values(acc_chunks, correction_H, p_smem, kv_smem.at[slot], chunk_cols)
        plgpu.barrier_arrive(p_free.at[0])
        plgpu.barrier_arrive(kv_free.at[slot])
        return acc_chunks

    acc_chunks = lax.fori_loop(0, num_tiles, tile_step, acc_init)
    plgpu.barrier_wait(p_ready.at[0])
    _store_normalised(o_gmem, acc_chunks, chunk_cols, cast(l_smem[...], plgpu.Layout.WGMMA.reduce(1)))


def _producer(
    batch, first_tile, num_tiles, q_gmem, cache_tile, q_smem, kv_smem, kv_ready, kv_free, q_ready, *, stages: int
):
    """The producer warpgroup: the query once, then cache tiles through the ring (cache_tile(i): the GMEM view
    of the sequence's tile i)."""
    plgpu.set_max_registers(40, action="decrease")
    plgpu.copy_gmem_to_smem(q_gmem.at[batch], q_smem, q_ready.at[0])

    def load_tile(t, slot):
        plgpu.copy_gmem_to_smem(cache_tile(first_tile + t), kv_smem.at[slot], kv_ready.at[slot])

    mosaic_parts.fill_ring(num_tiles, stages, load_tile, kv_free)


def _kernel(
    cache_tile,
    lengths_gmem,
    q_gmem,
    o_gmem,
    lse_gmem,
    q_smem,
    kv_smem,
    p_smem,
    correction_smem,
    l_smem,
    kv_ready,
    kv_free,
    q_ready,
    p_ready,
    p_free,
    *,
    scale: float,
    block_k: int,
    split_len: int,
    stages: int,
    pv_chunk: int,
    interpret: bool,
):
    """The CTA of (batch, split): its warpgroups' roles; cache_tile(i) is the GMEM view of tile i of the
    sequence (block_k slots), contiguous or paged."""
    batch, split, warpgroup = lax.axis_index("batch"), lax.axis_index("split"), lax.axis_index("wg")
    length = lengths_gmem[batch]
    first_slot = split * split_len
    num_tiles = jnp.clip(lax.div(length - first_slot + block_k - 1, block_k), 0, split_len // block_k)
    refs = (
        q_smem,
        kv_smem,
        p_smem,
        correction_smem,
        l_smem,
        (kv_ready, kv_free, q_ready, p_ready, p_free),
        o_gmem.at[batch, split],
        lse_gmem.at[batch, split],
    )
    cast = mosaic_parts.keep_layout if interpret else plgpu.layout_cast
    pl.when(warpgroup == 0)(
        functools.partial(
            _scores_consumer,
            length,
            first_slot,
            num_tiles,
            refs,
            scale=scale,
            block_k=block_k,
            stages=stages,
            pv_chunk=pv_chunk,
            cast=cast,
        )
    )
    pl.when(warpgroup == 1)(
        functools.partial(_values_consumer, num_tiles, refs, stages=stages, pv_chunk=pv_chunk, cast=cast)
    )
    pl.when(warpgroup == CONSUMERS)(
        functools.partial(
            _producer,
            batch,
            split * (split_len // block_k),
            num_tiles,
            q_gmem,
            cache_tile,
            q_smem,
            kv_smem,
            kv_ready,
            kv_free,
            q_ready,
            stages=stages,
        )
    )


def _contiguous_kernel(lengths_gmem, q_gmem, kv_gmem, *refs, block_k: int, **params):
    """Tile i of sequence b: cache slots [i * block_k, +block_k) of kv [B, L, A]."""
    batch = lax.axis_index("batch")
    _kernel(
        lambda i: kv_gmem.at[batch, pl.ds(i * block_k, block_k)], lengths_gmem, q_gmem, *refs, block_k=block_k, **params
    )


def _paged_kernel(lengths_gmem, q_gmem, pages_gmem, page_table_gmem, *refs, block_k: int, page_size: int, **params):
    """Tile i of sequence b: rows of page page_table[b, i // tiles_per_page] of pages [P, page_size, A] (the
    row offset a multiple of block_k, so TMA's 8-row alignment is provable)."""
    batch = lax.axis_index("batch")
    tiles_per_page = page_size // block_k

    def cache_tile(i):
        page = page_table_gmem[batch, lax.div(i, tiles_per_page)]
        return pages_gmem.at[page, pl.ds(lax.rem(i, tiles_per_page) * block_k, block_k)]

    _kernel(cache_tile, lengths_gmem, q_gmem, *refs, block_k=block_k, **params)


MIN_SPLIT = 512  # slots


def default_num_splits(batch: int, max_len: int, num_sms: int = 132) -> int:
    """At most one CTA per SM over the whole batch (each CTA holds ~210 KiB of shared memory, so only one
    fits an SM): B=64 -> 2 splits, B=8 -> 16, B=1 -> 132; splits of at least MIN_SPLIT slots."""
    return max(1, min(num_sms // batch, pl.cdiv(max_len, MIN_SPLIT)))


def _check(q_latent_BHR, dtype, width: int, *, block_k: int, pv_chunk: int):
    heads, latent_dim = q_latent_BHR.shape[1:]
    if dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"mla_decode_mgpu takes a bf16 or fp16 cache, got {dtype}")
    if heads > HEADS or width % 64 or latent_dim % (CONSUMERS * pv_chunk) or block_k % 64:
        raise ValueError(
            f"mla_decode_mgpu needs <= {HEADS} heads, a cache width that is a multiple of 64, a latent "
            f"dim that is a multiple of {CONSUMERS} x pv_chunk and block_k a multiple of 64; got "
            f"{heads} heads, cache width {width}, latent dim {latent_dim}, pv_chunk {pv_chunk}, "
            f"block_k {block_k}"
        )


def _run(
    body,
    cache_args,
    q_latent_BHR,
    q_rope_BHP,
    lengths_B,
    *,
    max_len: int,
    scale: float,
    tiles: tuned.DecodeMosaicTiles,
    num_splits: int | None,
    interpret: bool,
):
    """The kernel `body` over (batch, split) CTAs, then the exact combine of the splits: o_latent [B, H, R]."""
    block_k, stages, pv_chunk = tiles.block_k, tiles.stages, tiles.pv_chunk
    batch, heads, latent_dim = q_latent_BHR.shape
    dtype, width = cache_args[0].dtype, cache_args[0].shape[-1]
    _check(q_latent_BHR, dtype, width, block_k=block_k, pv_chunk=pv_chunk)
    if num_splits is None:
        num_splits = default_num_splits(batch, max_len)
    split_len = pl.cdiv(pl.cdiv(max_len, num_splits), block_k) * block_k
    q_BHA = jnp.concatenate([q_latent_BHR, q_rope_BHP], axis=-1).astype(dtype)
    q_BHA = jnp.pad(q_BHA, ((0, 0), (0, HEADS - heads), (0, 0)))
    layout = mosaic_parts.operand_layout()
    kernel = functools.partial(
        body, scale=scale, block_k=block_k, split_len=split_len, stages=stages, pv_chunk=pv_chunk, interpret=interpret
    )
    o_BSHR, lse_BSH = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((batch, num_splits, HEADS, latent_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_splits, HEADS), jnp.float32),
        ),
        scratch_types=(
            plgpu.SMEM((HEADS, width), dtype, transforms=layout),
            plgpu.SMEM((stages, block_k, width), dtype, transforms=layout),
            plgpu.SMEM((HEADS, block_k), dtype, transforms=layout),
            plgpu.SMEM((HEADS,), jnp.float32),
            plgpu.SMEM((HEADS,), jnp.float32),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_barriers=1),
        ),
        grid=(batch, num_splits),
        grid_names=("batch", "split"),
        **mosaic_parts.warpgroup_launch(CONSUMERS + 1, approx_math=tiles.approx_math, interpret=interpret),
    )(lengths_B.astype(jnp.int32), q_BHA, *cache_args)
    return combine_splits(o_BSHR, lse_BSH)[:, :heads]


_TUNING = ("scale", "tiles", "num_splits", "interpret")


@functools.partial(jax.jit, static_argnames=_TUNING)
def mla_decode_mgpu(
    q_latent_BHR,
    q_rope_BHP,
    kv_cache_BLA,
    lengths_B,
    *,
    scale: float,
    tiles: tuned.DecodeMosaicTiles | None = None,
    num_splits: int | None = None,
    interpret: bool = False,
):
    """o_latent [B, H, R] fp32 for a bf16 or fp16 cache [B, L, R + P] (R = 512, P = 64 for Ling; R and P
    multiples of 64 and 128 divides R), H <= 64 heads. Slots past L in the last tile read as zeros
    (TMA) and are masked like those past lengths[b]; a cache whose L is not a multiple of 8 is padded first (a
    copy: TMA needs whole 8-row tiles). Tiles: `block_k` slots a tile, `stages` ring buffers,
    P·V in `pv_chunk`-column products per consumer (each a fresh accumulator added to the rescaled output:
    fewer live registers than one [64, 256] product). approx_math: the softmax's exp in the
    fast approximate form (ex2.approx; the same error vs float64). None: `tuned.DECODE_MOSAIC`. num_splits:
    sequence splits, None for `default_num_splits`."""
    tiles = tiles or lookup(tuned.DECODE_MOSAIC, dtype=kv_cache_BLA.dtype)
    max_len = kv_cache_BLA.shape[1]
    if max_len % 8:  # a TMA source dimension must be a multiple of its 8-row tiling: odd lengths are padded
        kv_cache_BLA = jnp.pad(kv_cache_BLA, ((0, 0), (0, -max_len % 8), (0, 0)))
    return _run(
        _contiguous_kernel,
        (kv_cache_BLA,),
        q_latent_BHR,
        q_rope_BHP,
        lengths_B,
        max_len=max_len,
        scale=scale,
        tiles=tiles,
        num_splits=num_splits,
        interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=_TUNING)
def mla_decode_paged_mgpu(
    q_latent_BHR,
    q_rope_BHP,
    kv_pages_PSA,
    page_table_BN,
    lengths_B,
    *,
    scale: float,
    tiles: tuned.DecodeMosaicTiles | None = None,
    num_splits: int | None = None,
    interpret: bool = False,
):
    """`mla_decode_mgpu` over a paged cache: kv_pages [P, page_size, R + P_rope] (page_size a multiple of
    block_k), page_table [B, max_pages] int32: slot s of sequence b is row s % page_size of page
    page_table[b, s // page_size]. Pages may be shared between sequences (prefix reuse); entries past a
    sequence's length are never read."""
    tiles = tiles or lookup(tuned.DECODE_MOSAIC, dtype=kv_pages_PSA.dtype)
    page_size = kv_pages_PSA.shape[1]
    if page_size % tiles.block_k:
        raise ValueError(
            f"mla_decode_paged_mgpu needs a page size that is a multiple of block_k {tiles.block_k}, got {page_size}"
        )
    body = functools.partial(_paged_kernel, page_size=page_size)
    return _run(
        body,
        (kv_pages_PSA, page_table_BN.astype(jnp.int32)),
        q_latent_BHR,
        q_rope_BHP,
        lengths_B,
        max_len=page_table_BN.shape[1] * page_size,
        scale=scale,
        tiles=tiles,
        num_splits=num_splits,
        interpret=interpret,
    )
