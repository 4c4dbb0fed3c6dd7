"""Absorbed-MLA decode on TPU: Pallas Mosaic kernels, flash-decoding over sequence splits.

Grid (batch, split, block): the block axis walks one split of a sequence's latent cache a block of slots at a
time, accumulating the online softmax in VMEM scratch; splits are independent ("parallel", so both cores of a
megacore chip work on one sequence) and merged exactly by `combine_splits`. The cache length per sequence is
scalar-prefetched: blocks past it are neither computed nor fetched (the index maps clamp to the last useful
data, so the pipeline re-uses the buffer instead of issuing a DMA).

Two caches, one kernel body (`_split_kernel`): contiguous ([B, L, R + P], `mla_decode_tpu`: a block is one
`block_k`-slot tile) or paged ([num_pages, page_size, R + P] with a page table, `mla_decode_paged_tpu`: a block
is `pages_per_block` whole pages, each its own kernel operand (the pool passed once per page of a block) whose
index map reads its page id from SMEM, so the pages are DMA'd from the pool in place, never gathered; the
block's pages are joined in VMEM into one tile for the same math).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.mla import tuned
from pallas_kernels.mla.reference import combine_splits
from pallas_kernels.tuning import lookup

NEG_INF = -1e30
# The paged kernel's page ids (`block_pages`) live in SMEM (1 MiB a core from TPU v4 on), beside the lengths.
PAGE_TABLE_MAX_BYTES = 512 * 1024


def page_rows(dtype) -> int:
    """The sublane tile of `dtype` (8 rows of 32-bit values, 16 of 16-bit, 32 of 8-bit): a page must be whole
    tiles of it for its [page_size, R + P] block to sit on the TPU's (rows, 128) memory tiling, and for a block's
    pages to join into one tile without a relayout."""
    return 8 * 4 // jnp.dtype(dtype).itemsize


def _split_kernel(
    *refs,
    num_scalars: int,
    num_kv: int,
    scale: float,
    rows: int,
    blocks_per_split: int,
    latent_dim: int,
):
    """One grid step (b, split, block). refs: the scalar-prefetched lengths [B] (then `num_scalars` - 1 more
    prefetched operands, used only by the index maps), q_latent [H, R], q_rope [H, P], `num_kv` cache tiles of
    `rows` consecutive slots each [rows, R + P] (the block's slots in order, joined into one tile), the outputs
    o [H, R] and lse [H, 1], and the scratch acc [H, R], m [H, 1], l [H, 1]."""
    lengths_ref = refs[0]
    q_latent_ref, q_rope_ref = refs[num_scalars : num_scalars + 2]
    kv_refs = refs[num_scalars + 2 : num_scalars + 2 + num_kv]
    o_ref, lse_ref, acc_ref, m_ref, l_ref = refs[num_scalars + 2 + num_kv :]
    b, split, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = lengths_ref[b]
    first = (split * blocks_per_split + block) * (num_kv * rows)

    @pl.when(block == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        m_ref[...] = jnp.full_like(m_ref, NEG_INF)
        l_ref[...] = jnp.zeros_like(l_ref)

    @pl.when(first < length)
    def _accumulate():
        # [num_kv * rows, R + P]; rows past the cache end (a partial tile, a page past it) are garbage
        kv = kv_refs[0][...] if num_kv == 1 else jnp.concatenate([ref[...] for ref in kv_refs], axis=0)
        valid_K1 = first + lax.broadcasted_iota(jnp.int32, (kv.shape[0], 1), 0) < length
        kv = jnp.where(valid_K1, kv, jnp.zeros_like(kv))
        k_latent, k_rope = kv[:, :latent_dim], kv[:, latent_dim:]
        contract = (((1,), (1,)), ((), ()))
        scores = lax.dot_general(
            q_latent_ref[...], k_latent, contract, preferred_element_type=jnp.float32
        ) + lax.dot_general(q_rope_ref[...], k_rope, contract, preferred_element_type=jnp.float32)
        slots = first + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        scores = jnp.where(slots < length, scores * scale, NEG_INF)  # [H, block]
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


def _split_call(
    scalars: tuple,
    q_latent_BHR,
    q_rope_BHP,
    kv_operands: tuple,
    kv_specs: list,
    *,
    rows: int,
    num_splits: int,
    blocks_per_split: int,
    scale: float,
    interpret: bool,
):
    """The kernel over grid (batch, num_splits, blocks_per_split), its splits combined -> o_latent [B, H, R] fp32.
    scalars: the prefetched operands (the lengths first); kv_operands / kv_specs: the block's cache tiles."""
    batch, heads, latent_dim = q_latent_BHR.shape
    rope_dim = q_rope_BHP.shape[-1]
    dtype = kv_operands[0].dtype
    num_scalars = len(scalars)

    kernel = functools.partial(
        _split_kernel,
        num_scalars=num_scalars,
        num_kv=len(kv_operands),
        scale=scale,
        rows=rows,
        blocks_per_split=blocks_per_split,
        latent_dim=latent_dim,
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=num_scalars,
        grid=(batch, num_splits, blocks_per_split),
        in_specs=[
            pl.BlockSpec((None, heads, latent_dim), lambda b, s, j, *_: (b, 0, 0)),
            pl.BlockSpec((None, heads, rope_dim), lambda b, s, j, *_: (b, 0, 0)),
            *kv_specs,
        ],
        out_specs=[
            pl.BlockSpec((None, None, heads, latent_dim), lambda b, s, j, *_: (b, s, 0, 0)),
            pl.BlockSpec((None, None, heads, 1), lambda b, s, j, *_: (b, s, 0, 0)),
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
    )(*scalars, q_latent_BHR.astype(dtype), q_rope_BHP.astype(dtype), *kv_operands)
    return combine_splits(o_BSHR, lse_BSH1[..., 0])


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
    max_len, width = kv_cache_BLA.shape[1:]
    if block_k % 16:
        raise ValueError(f"block_k must be a multiple of 16, got {block_k}")
    block_k = min(block_k, max_len)
    total_blocks = pl.cdiv(max_len, block_k)
    num_splits = min(num_splits, total_blocks)
    blocks_per_split = pl.cdiv(total_blocks, num_splits)

    def kv_index(b, s, j, lengths_ref):
        last_useful = jnp.maximum(pl.cdiv(lengths_ref[b], block_k) - 1, 0)
        return b, jnp.minimum(jnp.minimum(s * blocks_per_split + j, last_useful), total_blocks - 1), 0

    return _split_call(
        (lengths_B.astype(jnp.int32),),
        q_latent_BHR,
        q_rope_BHP,
        (kv_cache_BLA,),
        [pl.BlockSpec((None, block_k, width), kv_index)],
        rows=block_k,
        num_splits=num_splits,
        blocks_per_split=blocks_per_split,
        scale=scale,
        interpret=interpret,
    )


def block_pages(page_table_BN, lengths_B, *, num_pages: int, page_size: int, pages_per_block: int, num_blocks: int):
    """The page each kernel operand reads at each block: [B, num_blocks * pages_per_block] int32, entry
    (b, block * pages_per_block + i) for operand i (page i of a block). That is table column block *
    pages_per_block + i while that page holds some of sequence b; past it, the last column of operand i that does
    (the same page as the step before: the pipeline issues no DMA), or column i where operand i has none (its
    page, whatever the table holds there, is read once and masked); the id clipped to [0, num_pages). Computed
    by XLA on the table (a few KB), so that each operand's index map is one SMEM read."""
    max_pages = page_table_BN.shape[1]
    i = jnp.arange(pages_per_block)
    last_page_B11 = jnp.clip(pl.cdiv(lengths_B, page_size) - 1, 0, max_pages - 1)[:, None, None]
    own_last_B1I = i + jnp.maximum(last_page_B11 - i, 0) // pages_per_block * pages_per_block
    columns_BGI = jnp.minimum(jnp.arange(num_blocks)[:, None] * pages_per_block + i, own_last_B1I)
    pages = jnp.take_along_axis(page_table_BN, columns_BGI.reshape(len(lengths_B), -1), axis=1)
    return jnp.clip(pages, 0, num_pages - 1).astype(jnp.int32)


def _paged_grid(page_size: int, max_pages: int, tiles: tuned.DecodeTpuTiles) -> tuple[int, int, int]:
    """(pages a block, splits, blocks a split) of the paged kernel's grid."""
    pages_per_block = max(1, min(tiles.block_k // page_size, max_pages))
    total_blocks = pl.cdiv(max_pages, pages_per_block)
    num_splits = min(tiles.num_splits, total_blocks)
    return pages_per_block, num_splits, pl.cdiv(total_blocks, num_splits)


def paged_kernel_fits(kv_pages_PSA, page_table_BN, tiles: tuned.DecodeTpuTiles | None = None) -> bool:
    """Whether `mla_decode_paged_tpu` takes this cache: pages of whole sublane tiles (`page_rows`: a multiple of
    16 slots for a bf16 cache, 8 for fp32) and its per-block page ids (`block_pages`: about the table's size) in
    at most PAGE_TABLE_MAX_BYTES of SMEM. tiles None: `tuned.DECODE_PAGED_TPU`'s."""
    tiles = tiles or lookup(tuned.DECODE_PAGED_TPU, dtype=kv_pages_PSA.dtype)
    batch, max_pages = page_table_BN.shape
    pages_per_block, num_splits, blocks_per_split = _paged_grid(kv_pages_PSA.shape[1], max_pages, tiles)
    ids = batch * num_splits * blocks_per_split * pages_per_block
    return kv_pages_PSA.shape[1] % page_rows(kv_pages_PSA.dtype) == 0 and ids * 4 <= PAGE_TABLE_MAX_BYTES


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def mla_decode_paged_tpu(
    q_latent_BHR,
    q_rope_BHP,
    kv_pages_PSA,
    page_table_BN,
    lengths_B,
    *,
    scale: float,
    tiles: tuned.DecodeTpuTiles | None = None,
    interpret: bool = False,
):
    """`mla_decode_tpu` over a paged cache, the pages read in place: kv_pages [num_pages, page_size, R + P]
    (page_size a multiple of `page_rows(dtype)`), page_table [B, max_pages] int32 (slot s of sequence b is row
    s % page_size of page page_table[b, s // page_size]; pages may be shared between sequences, entries past a
    sequence's length may hold anything). A block is tiles.block_k // page_size whole pages (at least one);
    None: `tuned.DECODE_PAGED_TPU`."""
    tiles = tiles or lookup(tuned.DECODE_PAGED_TPU, dtype=kv_pages_PSA.dtype)
    num_pages, page_size, width = kv_pages_PSA.shape
    batch, max_pages = page_table_BN.shape
    if not paged_kernel_fits(kv_pages_PSA, page_table_BN, tiles):
        raise ValueError(
            f"mla_decode_paged_tpu needs pages of a multiple of {page_rows(kv_pages_PSA.dtype)} slots "
            f"({kv_pages_PSA.dtype.name}) and at most {PAGE_TABLE_MAX_BYTES} bytes of page ids, got page_size "
            f"{page_size} and a [{batch}, {max_pages}] table"
        )
    pages_per_block, num_splits, blocks_per_split = _paged_grid(page_size, max_pages, tiles)
    num_blocks = num_splits * blocks_per_split  # the grid's: past the table's last block too
    pages_BX = block_pages(
        page_table_BN,
        lengths_B,
        num_pages=num_pages,
        page_size=page_size,
        pages_per_block=pages_per_block,
        num_blocks=num_blocks,
    )

    def page_index(i):
        def index(b, s, j, lengths_ref, pages_ref):
            return pages_ref[(b * num_blocks + s * blocks_per_split + j) * pages_per_block + i], 0, 0

        return index

    return _split_call(
        (lengths_B.astype(jnp.int32), pages_BX.reshape(-1)),
        q_latent_BHR,
        q_rope_BHP,
        (kv_pages_PSA,) * pages_per_block,
        [pl.BlockSpec((None, page_size, width), page_index(i)) for i in range(pages_per_block)],
        rows=page_size,
        num_splits=num_splits,
        blocks_per_split=blocks_per_split,
        scale=scale,
        interpret=interpret,
    )
