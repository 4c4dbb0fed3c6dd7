"""MLA prefill attention on Hopper: a Pallas Mosaic GPU flash-attention kernel (wgmma, TMA, a producer warpgroup
and two consumer warpgroups) over segments of expanded keys.

`flash_expanded_attention_mgpu` has the semantics of `flash_expanded_attention` (`mla/reference.py`) and walks
the latent cache in segments as the Triton kernel does (`gpu_triton/prefill.py`): per segment XLA expands the
keys once, laid out for wgmma without transposes, nope K^T [B, H, N, S], the heads' shared rope K^T [B, P, S]
and V [B, H, S, V], and the kernel merges the segment into the running (output, log-sum-exp) pair.

A CTA serves 128 queries of one head and sequence with three warpgroups:

- the producer loads each consumer's 64 queries [64, N + P], running output [64, V] fp32, log-sum-exp and
  query slots once, then streams key tiles (K^T [N + P, block_k] from its nope and rope rows, V [block_k, V] and
  the keys' validity) through a ring of `stages` shared-memory buffers with TMA, refilling a buffer when both
  consumers release it;
- each consumer resumes the online softmax from its rows' running pair (`online_softmax.resume`: the max at the
  log-sum-exp, a sum of 1), forms S = Q K^T for a tile, masks it (key slot <= query slot, key valid) unless
  every query of the block sees the whole tile, takes the softmax in base 2 (the scale folded into one fused
  multiply-add before exp2), writes P (16-bit) to shared memory (or keeps it in registers: `p_in_registers`)
  and adds P V to its [64, V] fp32 accumulator; at the end it writes the pair back through shared memory with TMA.

The CTA walks the key tiles up to the last one its queries can see, the tiles its queries see whole unmasked
(both counted by XLA per segment: `_tile_walk`). Queries go in padded to whole 128-row blocks (pad rows see no
key). P V is a fresh wgmma product added to the rescaled accumulator in registers: jax 0.10's Mosaic GPU
interpreter cannot accumulate into a pre-initialised accumulator, nor its warpgroup lowering lower one inside the
key loop. No operand is transposed, so the kernel runs in that interpreter on a CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mla import key_segments, mosaic_parts, tuned
from pallas_kernels.mla.gpu_triton import online_softmax
from pallas_kernels.tuning import lookup

ROWS = 64  # queries a consumer warpgroup: wgmma's M
CONSUMERS = 2
QUERY_BLOCK = CONSUMERS * ROWS
PRODUCER_LOADS = 4  # a consumer's queries, running output, log-sum-exp, query slots
TILE_LOADS = 4  # a key tile's K^T (nope rows, rope rows), V, validity
LOG2_E, LN_2 = math.log2(math.e), math.log(2.0)


def kernel_dims_fit(*head_dims: int) -> bool:
    """Whether the kernel takes these nope, rope and value dims: nope + rope and value multiples of 64 (whole
    128-byte swizzle tiles of 16-bit values), nope a multiple of 8 (the rope rows of a key tile start on a tile of
    8 rows)."""
    nope, rope, value = head_dims
    return (nope + rope) % 64 == 0 and value % 64 == 0 and nope % 8 == 0


def _operand(shape, dtype):
    return plgpu.SMEM(shape, dtype, transforms=mosaic_parts.operand_layout())


def _consumer(consumer, first_slot, walk, smem, barriers, out, *, scale, tiles, interpret):
    """One consumer warpgroup: its 64 queries' attention over the segment's first key tiles, merged into their
    running pair, written to `out` (its GMEM views of the output and log-sum-exp).

    walk = (num_tiles, open_start, open_end): the block's key tiles, and the tiles [open_start, open_end) that every
    query of the block sees whole (valid keys at or before every query's slot), taken without the mask.
    The softmax runs in base 2 with the scale folded in: the max on the unscaled scores, p = 2^(s c - m c).
    ping_pong: the two consumers meet at two points a tile (after issuing the scores' product, after the softmax),
    consumer 1 one meeting behind, so that one's softmax runs while the other's products occupy the tensor cores.
    p_in_registers (compiled only: jax 0.10's interpreter takes no register operand): P goes to wgmma from
    registers, not through shared memory.
    overlap_softmax: tile t's softmax runs while the tensor cores form tile t + 1's scores (two score tiles live in
    registers); the last tile's softmax and P V follow the loop, masked."""
    num_tiles, open_start, open_end = walk
    block_k, stages = tiles.block_k, tiles.stages
    p_in_registers = tiles.p_in_registers and not interpret
    q_smem, k_smem, v_smem, p_smem, valid_smem, slots_smem, o_smem, lse_smem = smem
    kv_ready, kv_free, start_ready, schedule = barriers
    to_log2 = scale * LOG2_E  # unscaled score -> base-2 exponent

    def meet():
        if tiles.ping_pong:
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(schedule)

    cast = mosaic_parts.keep_layout if interpret else plgpu.layout_cast
    row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    plgpu.set_max_registers(232, action="increase")
    plgpu.barrier_wait(start_ready.at[consumer])
    slots_R = cast(slots_smem.at[consumer][...], row_layout)
    acc_RV, lse_max_R, l_R = online_softmax.resume(
        cast(o_smem.at[consumer][...], plgpu.Layout.WGMMA), cast(lse_smem.at[consumer][...], row_layout)
    )
    shape, value_dim = (ROWS, block_k), o_smem.shape[-1]

    def scores(t, during):
        """S = Q K^T for tile t, during() run while the tensor cores form it: (S [64, block_k], during's)."""
        plgpu.barrier_wait(kv_ready.at[lax.rem(t, stages)])
        return mosaic_parts.product_while(q_smem.at[consumer], k_smem.at[lax.rem(t, stages)], *shape, during)

    def softmax(t, scores_RK, m_R, l_R, masked: bool):
        """Tile t's softmax weights P (16-bit, in registers; None: written to shared memory) against the new running
        max (a base-2 exponent), the new sum and the old accumulator's correction."""
        if masked:
            column_RK = cast(lax.broadcasted_iota(jnp.int32, shape, 1), plgpu.Layout.WGMMA)
            valid_RK = lax.broadcast_in_dim(cast(valid_smem.at[lax.rem(t, stages)][...], col_layout), shape, [1])
            visible_RK = first_slot + t * block_k + column_RK <= lax.broadcast_in_dim(slots_R, shape, [0])
            scores_RK = jnp.where(visible_RK & (valid_RK != 0), scores_RK, -jnp.inf)
        m_new = jnp.maximum(m_R, scores_RK.max(axis=1) * to_log2)
        correction_R = jnp.exp2(m_R - m_new)
        p_RK = jnp.exp2(scores_RK * to_log2 - lax.broadcast_in_dim(m_new, shape, [0]))
        l_R = l_R * correction_R + p_RK.sum(axis=1)
        if p_in_registers:
            return p_RK.astype(p_smem.dtype), m_new, l_R, correction_R
        p_smem.at[consumer][...] = p_RK.astype(p_smem.dtype)
        plgpu.commit_smem()
        return None, m_new, l_R, correction_R

    def add_values(t, p_RK, acc_RV, correction_R):
        """The accumulator rescaled plus P V for tile t (P: p_RK, or shared memory's where None), whose buffer is
        then released."""
        operand = p_smem.at[consumer] if p_RK is None else p_RK
        rescaled_RV = acc_RV * lax.broadcast_in_dim(correction_R, acc_RV.shape, [0])
        acc_RV = rescaled_RV + mosaic_parts.product(operand, v_smem.at[lax.rem(t, stages)], ROWS, value_dim)
        plgpu.barrier_arrive(kv_free.at[lax.rem(t, stages)])
        return acc_RV

    def tile_step(masked: bool):
        """One key tile: S, then (ping-pong's second meeting) P and P V."""

        def step(t, carry):
            acc_RV, m_R, l_R = carry
            scores_RK, _ = scores(t, meet)
            p_RK, m_R, l_R, correction_R = softmax(t, scores_RK, m_R, l_R, masked)
            meet()
            return add_values(t, p_RK, acc_RV, correction_R), m_R, l_R

        return step

    def overlapped_step(masked: bool):
        """Tile t's softmax while the tensor cores form tile t + 1's S, then tile t's P V (ping-pong's meetings
        before the S product and before P V)."""

        def step(t, carry):
            acc_RV, m_R, l_R, scores_RK = carry
            meet()  # before the wait for tile t + 1, whose buffer the other consumer frees after this meeting
            next_scores_RK, (p_RK, m_R, l_R, correction_R) = scores(
                t + 1, lambda: softmax(t, scores_RK, m_R, l_R, masked)
            )
            meet()
            return add_values(t, p_RK, acc_RV, correction_R), m_R, l_R, next_scores_RK

        return step

    def walk_tiles(step_of, end, carry):
        """carry after step_of(masked)(t, ...) for t in [0, end): unmasked within the block's open range."""
        start, stop = jnp.minimum(open_start, end), jnp.minimum(open_end, end)
        for masked, low, high in ((True, 0, start), (False, start, stop), (True, stop, end)):
            carry = lax.fori_loop(low, high, step_of(masked), carry)
        return carry

    if consumer == 1:
        meet()
    carry = (acc_RV, lse_max_R * LOG2_E, l_R)
    if tiles.overlap_softmax:  # the last tile (tile 0, fully masked, where the block sees none) after the loop
        last = jnp.maximum(num_tiles, 1) - 1
        acc_RV, m_R, l_R, scores_RK = walk_tiles(overlapped_step, last, (*carry, scores(0, meet)[0]))
        p_RK, m_R, l_R, correction_R = softmax(last, scores_RK, m_R, l_R, masked=True)
        meet()
        acc_RV = add_values(last, p_RK, acc_RV, correction_R)
    else:
        acc_RV, m_R, l_R = walk_tiles(tile_step, num_tiles, carry)
    if consumer == 0:
        meet()
    seen_R = l_R > 0
    total_R = jnp.where(seen_R, l_R, 1.0)
    o_smem.at[consumer][...] = acc_RV / lax.broadcast_in_dim(total_R, acc_RV.shape, [0])
    lse_smem.at[consumer][...] = jnp.where(seen_R, m_R * LN_2 + jnp.log(total_R), -jnp.inf)
    plgpu.commit_smem()
    o_gmem, lse_gmem = out
    plgpu.copy_smem_to_gmem(o_smem.at[consumer], o_gmem)
    plgpu.copy_smem_to_gmem(lse_smem.at[consumer], lse_gmem)
    plgpu.wait_smem_to_gmem(0)


def _tiles_loaded(num_tiles, tiles: tuned.PrefillMosaicTiles):
    """The key tiles the producer streams: the block's, at least one with overlap_softmax (whose consumers take
    a first tile's scores before their loop)."""
    return jnp.maximum(num_tiles, 1) if tiles.overlap_softmax else num_tiles


def _producer(num_tiles, starts, tile, smem, barriers, *, stages):
    """The producer warpgroup: each consumer's start (starts(c): (GMEM, SMEM) pairs), then the key tiles
    through the ring (tile(t): (GMEM, SMEM-of-a-slot) pairs)."""
    kv_ready, kv_free, start_ready, _ = barriers
    plgpu.set_max_registers(40, action="decrease")
    for consumer in range(CONSUMERS):
        for src, dst in starts(consumer):
            plgpu.copy_gmem_to_smem(src, dst, start_ready.at[consumer])

    def load_tile(t, slot):
        for src, dst in tile(t, slot):
            plgpu.copy_gmem_to_smem(src, dst, kv_ready.at[slot])

    mosaic_parts.fill_ring(num_tiles, stages, load_tile, kv_free)


def _kernel(
    first_gmem,
    walk_gmem,
    slots_gmem,
    valid_gmem,
    q_gmem,
    k_nope_gmem,
    k_pe_gmem,
    v_gmem,
    o_in_gmem,
    lse_in_gmem,
    o_gmem,
    lse_gmem,
    *scratch,
    scale: float,
    tiles: tuned.PrefillMosaicTiles,
    interpret: bool,
):
    """The CTA of (query block, head, sequence): its warpgroups' roles."""
    block_k, stages = tiles.block_k, tiles.stages
    smem, barriers = scratch[:8], scratch[8:]
    q_smem, k_smem, v_smem, _, valid_smem, slots_smem, o_smem, lse_smem = smem
    block, head, batch = lax.axis_index("q"), lax.axis_index("heads"), lax.axis_index("batch")
    warpgroup = lax.axis_index("wg")
    walk = tuple(walk_gmem[batch, block, i] for i in range(3))

    def rows(consumer):
        return pl.ds(block * QUERY_BLOCK + consumer * ROWS, ROWS)

    def starts(consumer):
        return (
            (q_gmem.at[batch, rows(consumer), head], q_smem.at[consumer]),
            (o_in_gmem.at[batch, rows(consumer), head], o_smem.at[consumer]),
            (lse_in_gmem.at[batch, head, rows(consumer)], lse_smem.at[consumer]),
            (slots_gmem.at[batch, rows(consumer)], slots_smem.at[consumer]),
        )

    def tile(t, slot):
        keys = pl.ds(t * block_k, block_k)
        return (
            (k_nope_gmem.at[batch, head, :, keys], k_smem.at[slot, : k_nope_gmem.shape[2]]),
            (k_pe_gmem.at[batch, :, keys], k_smem.at[slot, k_nope_gmem.shape[2] :]),
            (v_gmem.at[batch, head, keys], v_smem.at[slot]),
            (valid_gmem.at[batch, keys], valid_smem.at[slot]),
        )

    for consumer in range(CONSUMERS):
        out = (o_gmem.at[batch, rows(consumer), head], lse_gmem.at[batch, head, rows(consumer)])
        pl.when(warpgroup == consumer)(
            functools.partial(
                _consumer,
                consumer,
                first_gmem[0],
                walk,
                smem,
                barriers,
                out,
                scale=scale,
                tiles=tiles,
                interpret=interpret,
            )
        )
    pl.when(warpgroup == CONSUMERS)(
        functools.partial(_producer, _tiles_loaded(walk[0], tiles), starts, tile, smem, barriers, stages=stages)
    )


def _tile_walk(query_slots_BT, key_valid_BS, first_slot, block_k: int):
    """Each query block's walk over the segment's key tiles [B, T / 128, 3] int32: the tiles up to its last
    visible slot, and the range [open_start, open_end) of tiles every query of the block sees whole (each key
    valid and at or before the block's first slot; a block with a pad query, slot -1, has none)."""
    batch, length = query_slots_BT.shape
    segment = key_valid_BS.shape[1]
    slots_BQR = query_slots_BT.reshape(batch, length // QUERY_BLOCK, QUERY_BLOCK)
    count = segment // block_k
    tiles_BQ = jnp.clip((slots_BQR.max(axis=-1) - first_slot) // block_k + 1, 0, count)
    whole_BQ = jnp.clip((slots_BQR.min(axis=-1) - first_slot + 1) // block_k, 0, tiles_BQ)
    partly_invalid_BN = ~key_valid_BS.reshape(batch, count, block_k).all(axis=-1)
    after_tile_N = jnp.arange(1, count + 1)
    below_whole_BQN = after_tile_N[None, None, :] <= whole_BQ[..., None]
    open_start_BQ = jnp.max(jnp.where(below_whole_BQN & partly_invalid_BN[:, None, :], after_tile_N, 0), axis=-1)
    return jnp.stack([tiles_BQ, open_start_BQ, whole_BQ], axis=-1).astype(jnp.int32)


def attention_segment_mgpu(
    q_BTHD,
    k_nope_BHNS,
    k_pe_BPS,
    v_BHSV,
    query_slots_BT,
    key_valid_BS,
    first_slot,
    o_BTHV,
    lse_BHT,
    *,
    scale: float,
    tiles: tuned.PrefillMosaicTiles,
    interpret: bool = False,
):
    """The running attention (o [B, T, H, V] fp32, normalised, lse [B, H, T]; zeros and -inf where no key was
    seen) with the segment's keys (slots first_slot + [0, S)) merged in. q [B, T, H, N + P] (nope then rope
    columns), the keys transposed: nope K^T [B, H, N, S] and the heads' shared rope K^T [B, P, S]; V [B, H, S, V];
    16-bit, T a multiple of 128, S of block_k."""
    batch, length, heads, width = q_BTHD.shape
    value_dim = v_BHSV.shape[-1]
    block_k, stages = tiles.block_k, tiles.stages
    dtype = q_BTHD.dtype
    walk_BQ3 = _tile_walk(query_slots_BT, key_valid_BS, first_slot, block_k)

    def mla_prefill_mgpu(*refs):  # the kernel's name in jaxprs and profiles
        _kernel(*refs, scale=scale, tiles=tiles, interpret=interpret)

    return plgpu.kernel(
        mla_prefill_mgpu,
        out_type=(
            jax.ShapeDtypeStruct((batch, length, heads, value_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, heads, length), jnp.float32),
        ),
        scratch_types=(
            _operand((CONSUMERS, ROWS, width), dtype),
            _operand((stages, width, block_k), dtype),
            _operand((stages, block_k, value_dim), dtype),
            _operand((CONSUMERS, ROWS, block_k), dtype),
            plgpu.SMEM((stages, block_k), jnp.int32),
            plgpu.SMEM((CONSUMERS, ROWS), jnp.int32),
            plgpu.SMEM((CONSUMERS, ROWS, value_dim), jnp.float32),
            plgpu.SMEM((CONSUMERS, ROWS), jnp.float32),
            plgpu.Barrier(num_arrivals=TILE_LOADS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=PRODUCER_LOADS, num_barriers=CONSUMERS),
            plgpu.Barrier(num_arrivals=CONSUMERS),
        ),
        grid=(length // QUERY_BLOCK, heads, batch),
        grid_names=("q", "heads", "batch"),
        **mosaic_parts.warpgroup_launch(CONSUMERS + 1, approx_math=tiles.approx_math, interpret=interpret),
    )(
        jnp.asarray(first_slot, jnp.int32).reshape(1),
        walk_BQ3,
        query_slots_BT.astype(jnp.int32),
        key_valid_BS.astype(jnp.int32),
        q_BTHD,
        k_nope_BHNS,
        k_pe_BPS,
        v_BHSV,
        o_BTHV,
        lse_BHT,
    )


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def flash_expanded_attention_mgpu(
    q_nope_BTHN,
    q_pe_BTHP,
    latent_BSA,
    query_slots_BT,
    key_valid_BS,
    w_uk_HNR,
    w_uv_HVR,
    *,
    scale: float,
    tiles: tuned.PrefillMosaicTiles | None = None,
    interpret: bool = False,
):
    """Expanded MLA attention -> o [B, T, H, V] in q's dtype (arguments as for `flash_expanded_attention`), q
    bf16 or fp16. Tiles: None from `tuned.PREFILL_MOSAIC`."""
    dtype = q_nope_BTHN.dtype
    batch, length, heads, nope = q_nope_BTHN.shape
    rope, value_dim, latent_dim = q_pe_BTHP.shape[-1], w_uv_HVR.shape[1], w_uk_HNR.shape[-1]
    if dtype not in (jnp.bfloat16, jnp.float16) or not kernel_dims_fit(nope, rope, value_dim):
        raise ValueError(
            "the Mosaic GPU MLA prefill kernel takes bf16 or fp16 queries, nope + rope and value dims that are "
            f"multiples of 64, nope a multiple of 8; got {jnp.dtype(dtype).name}, nope {nope}, rope {rope}, "
            f"value {value_dim}"
        )
    tiles = tiles or lookup(tuned.PREFILL_MOSAIC, dtype=dtype)
    segment = min(tiles.segment, pl.cdiv(latent_BSA.shape[1], tiles.block_k) * tiles.block_k)
    w_uk, w_uv = w_uk_HNR.astype(dtype), w_uv_HVR.astype(dtype)
    query_pad = ((0, 0), (0, -length % QUERY_BLOCK))
    q_BTHD = jnp.pad(jnp.concatenate([q_nope_BTHN, q_pe_BTHP], axis=-1), query_pad + ((0, 0), (0, 0)))
    query_slots = jnp.pad(query_slots_BT.astype(jnp.int32), query_pad, constant_values=-1)
    padded = q_BTHD.shape[1]
    attend = functools.partial(
        attention_segment_mgpu,
        scale=scale,
        tiles=dataclasses.replace(tiles, segment=segment),
        interpret=interpret,
    )

    def add_segment(first, block_BSA, valid_BS, carry):
        c_kv, k_pe_BSP = block_BSA[..., :latent_dim], block_BSA[..., latent_dim:]
        k_nope_BHNS = jnp.einsum("bsr,hnr->bhns", c_kv, w_uk)
        v_BHSV = jnp.einsum("bsr,hvr->bhsv", c_kv, w_uv)
        return attend(q_BTHD, k_nope_BHNS, k_pe_BSP.transpose(0, 2, 1), v_BHSV, query_slots, valid_BS, first, *carry)

    nothing_seen = (
        jnp.zeros((batch, padded, heads, value_dim), jnp.float32),
        jnp.full((batch, heads, padded), -jnp.inf, jnp.float32),
    )
    latent = latent_BSA.astype(dtype)
    o, _ = key_segments.walk(latent, key_valid_BS, query_slots, segment, add_segment, nothing_seen)
    return o[:, :length].astype(dtype)
