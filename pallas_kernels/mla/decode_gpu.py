"""Absorbed-MLA decode on GPU: a Pallas kernel (Triton lowering), flash-decoding over sequence splits.

Program (head block, split, batch) walks its split of one sequence's latent cache in blocks of `block_k`
slots, all heads of the block sharing each loaded [c_kv ; k_pe] tile (the attention is MQA), and writes
its softmax-normalised partial output plus log-sum-exp; `combine_splits` merges the splits exactly.
Head blocks vary fastest in the grid so the programs that share a cache tile run together (L2 reuse).

`latent_parts` > 1 splits the 512 output latent columns over that many programs, adjacent in the grid: each
still forms the full scores over all R + P columns but accumulates only its R / parts columns of P·V, so its
fp32 accumulator is [head_block, R / parts] (128 registers a thread at 64 heads and 8 warps unsplit, 64 for
halves). Each part writes its own log-sum-exp (its score sums run in a different order), and the combine
treats (head, part) pairs as heads, so the merge stays exact.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.mla.reference import combine_splits


def _latent_parts(q_latent_ref, *, part, parts: int):
    """Column slices of the `parts` latent column parts, this program's own part first (its P·V values are
    the first cache piece it loads, so that piece serves both products), and the query pieces in that order.
    One part is the whole latent at a static offset (the unsplit kernel)."""
    width = q_latent_ref.shape[-1] // parts
    starts = [(part + j) % parts * width for j in range(parts)]
    if parts > 1:
        starts = [pl.multiple_of(start, width) for start in starts]
    cols = [pl.ds(start, width) for start in starts]
    return cols, [q_latent_ref[:, col] for col in cols]


def _split_kernel(lengths_ref, q_latent_ref, q_rope_ref, kv_latent_ref, kv_rope_ref, o_ref, lse_ref, *,
                  scale: float, block_k: int, split_len: int, parts: int):
    part = pl.program_id(0) % parts if parts > 1 else 0
    split = pl.program_id(1)
    length = lengths_ref[...]
    start = split * split_len
    cols, q_pieces = _latent_parts(q_latent_ref, part=part, parts=parts)  # parts x [hb, R/parts]
    q_rope = q_rope_ref[...]  # [hb, P]
    heads, width = q_pieces[0].shape
    offsets = jnp.arange(block_k)
    dot = functools.partial(plgpu.dot, allow_tf32=q_rope.dtype != jnp.float32)  # fp32 caches stay exact

    def body(i, carry):
        acc_HV, m_H, l_H = carry
        first = start + i * block_k
        valid_K = first + offsets < length
        rows = pl.ds(first, block_k)
        k_pieces = [plgpu.load(kv_latent_ref.at[rows, col], mask=valid_K[:, None], other=0.0) for col in cols]
        k_rope = plgpu.load(kv_rope_ref.at[rows, :], mask=valid_K[:, None], other=0.0)
        scores = dot(q_rope, k_rope, trans_b=True)
        for q_piece, k_piece in zip(q_pieces, k_pieces):
            scores += dot(q_piece, k_piece, trans_b=True)
        scores = jnp.where(valid_K[None, :], scores * scale, -jnp.inf)
        m_new = jnp.maximum(m_H, jnp.max(scores, axis=1))
        p = jnp.exp(scores - m_new[:, None])
        correction = jnp.exp(m_H - m_new)
        acc_HV = acc_HV * correction[:, None] + dot(p.astype(k_rope.dtype), k_pieces[0])  # P in the cache dtype
        return acc_HV, m_new, l_H * correction + jnp.sum(p, axis=1)

    num_blocks = jnp.clip(pl.cdiv(length - start, block_k), 0, split_len // block_k)
    init = (jnp.zeros((heads, width), jnp.float32), jnp.full((heads,), -1e30, jnp.float32),
            jnp.zeros((heads,), jnp.float32))
    acc_HV, m_H, l_H = jax.lax.fori_loop(0, num_blocks, body, init)
    seen = l_H > 0
    o_ref[...] = (acc_HV / jnp.where(seen, l_H, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m_H + jnp.log(jnp.where(seen, l_H, 1.0)), -jnp.inf)


# (block_k, head_block, num_warps) by cache itemsize, measured on an H200 (BENCHMARKS.md); fp32 tiles need
# half the size to fit the 227 KiB of shared memory with two pipeline stages.
DEFAULT_TILES = {2: (64, 64, 8), 4: (32, 16, 4)}


MIN_SPLIT = 256  # slots: four 64-slot blocks per program at least


def default_num_splits(batch: int, head_blocks: int, max_len: int) -> int:
    """About two programs per SM of an H100/H200 (132 SMs), splits of at most 4096 slots and at least
    MIN_SPLIT. Small batches want many splits: one sequence at 8192 slots ran in 74 us with 1024-slot splits
    (9 programs), a latency-bound walk; the fp32 partial outputs the extra splits write and the combine
    re-reads (splits x heads x 4 KiB) cost far less."""
    wanted = max(pl.cdiv(264, batch * head_blocks), pl.cdiv(max_len, 4096))
    return max(1, min(wanted, pl.cdiv(max_len, MIN_SPLIT)))


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "num_splits", "head_block", "num_warps",
                                             "num_stages", "latent_parts", "interpret"))
def mla_decode_gpu(q_latent_BHR, q_rope_BHP, kv_cache_BLA, lengths_B, *, scale: float, block_k: int | None = None,
                   num_splits: int | None = None, head_block: int | None = None, num_warps: int | None = None,
                   num_stages: int = 2, latent_parts: int = 1, interpret: bool = False):
    """o_latent [B, H, R] fp32. kv_cache [B, L, R + P]; R must be a multiple of P (512 and 64 for Ling) and of
    latent_parts (1, 2 or 4: output column parts, one program each). Tile sizes default to DEFAULT_TILES for
    the cache dtype; head_block >= 16 (heads are padded to it)."""
    default_tiles = DEFAULT_TILES.get(kv_cache_BLA.dtype.itemsize, DEFAULT_TILES[4])
    block_k, head_block, num_warps = (given or default for given, default in
                                      zip((block_k, head_block, num_warps), default_tiles))
    batch, heads, latent_dim = q_latent_BHR.shape
    rope_dim = q_rope_BHP.shape[-1]
    max_len = kv_cache_BLA.shape[1]
    if latent_dim % rope_dim or latent_dim % latent_parts:
        raise ValueError(f"latent dim {latent_dim} must be a multiple of the rope dim {rope_dim} and of "
                         f"latent_parts {latent_parts}")
    part_width = latent_dim // latent_parts
    head_blocks = pl.cdiv(heads, head_block)
    if num_splits is None:
        num_splits = default_num_splits(batch, head_blocks * latent_parts, max_len)
    split_len = pl.cdiv(pl.cdiv(max_len, num_splits), block_k) * block_k
    padded_heads = head_blocks * head_block
    pad = ((0, 0), (0, padded_heads - heads), (0, 0))
    q_latent = jnp.pad(q_latent_BHR.astype(kv_cache_BLA.dtype), pad)
    q_rope = jnp.pad(q_rope_BHP.astype(kv_cache_BLA.dtype), pad)
    grid = (head_blocks * latent_parts, num_splits, batch)  # a head block's column parts are adjacent

    def block_and_part(i):  # static (i, 0) unsplit, so that kernel's index arithmetic stays as it was
        return (i // latent_parts, i % latent_parts) if latent_parts > 1 else (i, 0)

    kernel = functools.partial(_split_kernel, scale=scale, block_k=block_k, split_len=split_len,
                               parts=latent_parts)
    o_BSHR, lse_BSHC = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None,), lambda i, s, b: (b,)),
            pl.BlockSpec((None, head_block, latent_dim), lambda i, s, b: (b, block_and_part(i)[0], 0)),
            pl.BlockSpec((None, head_block, rope_dim), lambda i, s, b: (b, block_and_part(i)[0], 0)),
            pl.BlockSpec((None, max_len, latent_dim), lambda i, s, b: (b, 0, 0)),
            pl.BlockSpec((None, max_len, rope_dim), lambda i, s, b: (b, 0, latent_dim // rope_dim)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, head_block, part_width), lambda i, s, b: (b, s, *block_and_part(i))),
            pl.BlockSpec((None, None, head_block, None), lambda i, s, b: (b, s, *block_and_part(i))),
        ],
        out_shape=[jax.ShapeDtypeStruct((batch, num_splits, padded_heads, latent_dim), jnp.float32),
                   jax.ShapeDtypeStruct((batch, num_splits, padded_heads, latent_parts), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="mla_decode_split",
    )(lengths_B.astype(jnp.int32), q_latent, q_rope, kv_cache_BLA, kv_cache_BLA)
    return _combine_parts(o_BSHR, lse_BSHC)[:, :heads]


def _combine_parts(o_BSHR, lse_BSHC):
    """combine_splits with each (head, column part) pair as one head: a part's columns are normalised by its
    own log-sum-exp, so the merge is exact for every part. Returns [B, H, R]."""
    batch, num_splits, heads, latent_dim = o_BSHR.shape
    parts = lse_BSHC.shape[-1]
    o_BSXV = o_BSHR.reshape(batch, num_splits, heads * parts, latent_dim // parts)
    return combine_splits(o_BSXV, lse_BSHC.reshape(batch, num_splits, heads * parts)).reshape(batch, heads, latent_dim)
