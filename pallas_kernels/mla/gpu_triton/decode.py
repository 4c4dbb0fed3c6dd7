"""Absorbed-MLA decode on GPU: a Pallas kernel (Triton lowering), flash-decoding over sequence splits, for one
query token a sequence (`mla_decode_gpu`) or a few (`mla_decode_tokens_gpu`, the MTP verify pass).

Program (head block, split, batch) walks its split of one sequence's latent cache in blocks of `block_k`
slots, all heads of the block sharing each loaded [c_kv ; k_pe] tile (the attention is MQA), and writes
its softmax-normalised partial output plus log-sum-exp; a second kernel merges the splits exactly
(`combine_splits_gpu`, program (sequence, head): `reference.combine_splits` in one launch where XLA runs four).
Head blocks vary fastest in the grid so the programs that share a cache tile run together (L2 reuse).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.mla import tuned
from pallas_kernels.mla.gpu_triton import online_softmax
from pallas_kernels.tuning import lookup


def _split_kernel(
    lengths_ref,
    q_latent_ref,
    q_rope_ref,
    kv_latent_ref,
    kv_rope_ref,
    o_ref,
    lse_ref,
    *,
    scale: float,
    block_k: int,
    split_len: int,
    per_head: bool,
):
    split = pl.program_id(1)
    length = lengths_ref[...]  # the row's visible slots, or per_head: each head's [hb]
    row_length = jnp.max(length) if per_head else length
    start = split * split_len
    q_latent = q_latent_ref[...]  # [hb, R]
    q_rope = q_rope_ref[...]  # [hb, P]
    heads, latent_dim = q_latent.shape
    offsets = jnp.arange(block_k)
    dot = functools.partial(plgpu.dot, allow_tf32=q_latent.dtype != jnp.float32)  # fp32 caches stay exact

    def body(i, carry):
        first = start + i * block_k
        valid_K = first + offsets < row_length
        rows = pl.ds(first, block_k)
        k_latent = plgpu.load(kv_latent_ref.at[rows, :], mask=valid_K[:, None], other=0.0)
        k_rope = plgpu.load(kv_rope_ref.at[rows, :], mask=valid_K[:, None], other=0.0)
        scores = (dot(q_latent, k_latent, trans_b=True) + dot(q_rope, k_rope, trans_b=True)) * scale
        visible = (first + offsets)[None, :] < length[:, None] if per_head else valid_K[None, :]
        return online_softmax.add_block(carry, scores, visible, k_latent, dot)

    num_blocks = jnp.clip(pl.cdiv(row_length - start, block_k), 0, split_len // block_k)
    carry = jax.lax.fori_loop(0, num_blocks, body, online_softmax.start(heads, latent_dim))
    online_softmax.store(o_ref, lse_ref, carry)


# slots: two 64-slot blocks a program at least (256 before: Ling-3.0-flash's first 24 layers on two H100s, decode at
# batch 1 2.21 -> 2.16 and 2.18 -> 2.15 ms, batches 8 and 32 unchanged:
# docs/benchmarks/generation.md#decode-at-batch-8-on-an-h100-the-gemv-at-8-rows-2026-12-06-twenty-first-session)
MIN_SPLIT = 128
COMBINE_COLUMNS = 128  # latent columns a step of the combine: [splits, 128] fp32 partials in registers


def _combine_kernel(o_ref, lse_ref, out_ref, *, splits: int):
    """out[b, h] = sum_s softmax_s(lse[b, :, h]) * o[b, s, h] (`reference.combine_splits`): the splits padded to a
    power of two (weight 0), the latent columns COMBINE_COLUMNS at a time."""
    sequence, head = pl.program_id(0), pl.program_id(1)
    padded = pl.next_power_of_2(splits)
    split_ok_S = jnp.arange(padded) < splits
    lse_S = plgpu.load(lse_ref.at[sequence, pl.ds(0, padded), head], mask=split_ok_S, other=-jnp.inf)
    lse_max = jnp.max(lse_S)
    weights_S = jnp.exp(lse_S - jnp.where(lse_max > -jnp.inf, lse_max, 0.0))
    total = jnp.sum(weights_S)
    weights_S = weights_S / jnp.where(total > 0, total, 1.0)
    latent_dim = out_ref.shape[2]
    columns = min(COMBINE_COLUMNS, latent_dim)
    for col0 in range(0, latent_dim, columns):
        cols = pl.ds(col0, columns)
        o_SC = plgpu.load(o_ref.at[sequence, pl.ds(0, padded), head, cols], mask=split_ok_S[:, None], other=0.0)
        out_ref[sequence, head, cols] = jnp.sum(weights_S[:, None] * o_SC, axis=0)


def combine_splits_gpu(o_BSHR, lse_BSH, *, interpret: bool = False):
    """`reference.combine_splits` as one Pallas kernel, program (sequence, head): [B, H, R] fp32. R a multiple of
    COMBINE_COLUMNS or a power of two below it."""
    batch, splits, heads, latent_dim = o_BSHR.shape
    whole = lambda array: pl.BlockSpec(array.shape, lambda b, h: (0,) * array.ndim)  # noqa: E731
    out_shape = jax.ShapeDtypeStruct((batch, heads, latent_dim), jnp.float32)
    return pl.pallas_call(
        functools.partial(_combine_kernel, splits=splits),
        grid=(batch, heads),
        in_specs=[whole(o_BSHR), whole(lse_BSH)],
        out_specs=whole(out_shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="mla_combine_splits",
    )(o_BSHR, lse_BSH)


def default_num_splits(batch: int, head_blocks: int, max_len: int) -> int:
    """About two programs per SM of an H100/H200 (132 SMs), splits of at most 4096 slots and at least
    MIN_SPLIT. Small batches want many splits: with few programs the walk is latency-bound, and the fp32 partial
    outputs the extra splits write and the combine re-reads (splits x heads x 4 KiB) cost far less."""
    wanted = max(pl.cdiv(264, batch * head_blocks), pl.cdiv(max_len, 4096))
    return max(1, min(wanted, pl.cdiv(max_len, MIN_SPLIT)))


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "num_splits", "interpret"))
def mla_decode_gpu(
    q_latent_BHR,
    q_rope_BHP,
    kv_cache_BLA,
    lengths_B,
    *,
    scale: float,
    tiles: tuned.DecodeTritonTiles | None = None,
    num_splits: int | None = None,
    interpret: bool = False,
):
    """o_latent [B, H, R] fp32. kv_cache [B, L, R + P]; R must be a multiple of P (512 and 64 for Ling).
    lengths: [B], each sequence's visible slots, or [B, H], each head's (`mla_decode_tokens_gpu`'s folded tokens).
    Tiles: None from `tuned.DECODE_TRITON` for the cache dtype; head_block >= 16 (heads are padded to it), and
    at most the heads' next power of two (Ling-3.0-flash's 32 heads: 32, not the table's 64, so that no padded
    head is computed and no padded head's fp32 partial output is written and combined).
    num_splits: sequence splits, None for `default_num_splits`."""
    tiles = tiles or lookup(tuned.DECODE_TRITON, dtype=kv_cache_BLA.dtype)
    batch, heads, latent_dim = q_latent_BHR.shape
    block_k, head_block = tiles.block_k, min(tiles.head_block, max(16, pl.next_power_of_2(heads)))
    rope_dim = q_rope_BHP.shape[-1]
    max_len = kv_cache_BLA.shape[1]
    if latent_dim % rope_dim:
        raise ValueError(f"latent dim {latent_dim} must be a multiple of the rope dim {rope_dim}")
    if num_splits is None:
        num_splits = default_num_splits(batch, pl.cdiv(heads, head_block), max_len)
    split_len = pl.cdiv(pl.cdiv(max_len, num_splits), block_k) * block_k
    padded_heads = pl.cdiv(heads, head_block) * head_block
    q_latent, q_rope = q_latent_BHR.astype(kv_cache_BLA.dtype), q_rope_BHP.astype(kv_cache_BLA.dtype)
    lengths = lengths_B.astype(jnp.int32)
    per_head = lengths.ndim == 2
    if padded_heads > heads:
        pad = ((0, 0), (0, padded_heads - heads), (0, 0))
        q_latent, q_rope = jnp.pad(q_latent, pad), jnp.pad(q_rope, pad)
        if per_head:  # padded heads see no slot
            lengths = jnp.pad(lengths, pad[:2])
    lengths_spec = (
        pl.BlockSpec((None, head_block), lambda h, s, b: (b, h))
        if per_head
        else pl.BlockSpec((None,), lambda h, s, b: (b,))
    )
    grid = (padded_heads // head_block, num_splits, batch)
    kernel = functools.partial(_split_kernel, scale=scale, block_k=block_k, split_len=split_len, per_head=per_head)
    o_BSHR, lse_BSH = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            lengths_spec,
            pl.BlockSpec((None, head_block, latent_dim), lambda h, s, b: (b, h, 0)),
            pl.BlockSpec((None, head_block, rope_dim), lambda h, s, b: (b, h, 0)),
            pl.BlockSpec((None, max_len, latent_dim), lambda h, s, b: (b, 0, 0)),
            pl.BlockSpec((None, max_len, rope_dim), lambda h, s, b: (b, 0, latent_dim // rope_dim)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, head_block, latent_dim), lambda h, s, b: (b, s, h, 0)),
            pl.BlockSpec((None, None, head_block), lambda h, s, b: (b, s, h)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_splits, padded_heads, latent_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_splits, padded_heads), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="mla_decode_split",
    )(lengths, q_latent, q_rope, kv_cache_BLA, kv_cache_BLA)
    return combine_splits_gpu(o_BSHR, lse_BSH, interpret=interpret)[:, :heads]


def mla_decode_tokens_gpu(
    q_latent_BTHR,
    q_rope_BTHP,
    kv_cache_BLA,
    lengths_BT,
    *,
    scale: float,
    tiles: tuned.DecodeTritonTiles | None = None,
    num_splits: int | None = None,
    interpret: bool = False,
):
    """o_latent [B, T, H, R] fp32 for T query tokens a sequence, token t over the first lengths[b, t] slots: the
    tokens' heads folded into one axis of T x H heads with per-head lengths (`mla_decode_gpu`), so a program
    reads each cache tile once for every token and head of its head block."""
    batch, tokens, heads, latent_dim = q_latent_BTHR.shape
    o_BMR = mla_decode_gpu(
        q_latent_BTHR.reshape(batch, tokens * heads, latent_dim),
        q_rope_BTHP.reshape(batch, tokens * heads, -1),
        kv_cache_BLA,
        jnp.repeat(lengths_BT, heads, axis=1),
        scale=scale,
        tiles=tiles,
        num_splits=num_splits,
        interpret=interpret,
    )
    return o_BMR.reshape(batch, tokens, heads, latent_dim)
