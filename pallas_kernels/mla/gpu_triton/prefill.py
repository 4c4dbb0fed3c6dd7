"""MLA prefill attention on GPU: a Pallas flash-attention kernel (Triton lowering) over one segment of
expanded keys, and the exact merge of segments.

`flash_expanded_attention_gpu` has the semantics of the jnp `flash_expanded_attention` (`mla/reference.py`): query
t sees key slot s iff s <= query_slots[b, t] and key_valid[b, s]. It walks the latent cache in segments of
`segment` slots; per segment XLA expands the keys once for all queries (k_nope [B, S, H, N] and v
[B, S, H, V] from c_kv with W_UK, W_UV; the rope key k_pe [B, S, P] is shared by the heads), and the kernel
runs flash attention over it: program (query block, head, sequence) resumes its online softmax from the running
(output, log-sum-exp) pair of the segments before (`online_softmax.resume`: an exact merge, in place), walks the
key blocks, stops at the last one any of its queries can see, and writes the pair back. So the expanded keys
never exceed one segment (at 4096 slots, B x 4096 x H x 256 values) and the partial outputs one [B, T, H, V]
fp32 array; segments past the last visible slot (the rest of a long cache) are skipped.

N, P, V must be powers of two of at least 16 (Ling: 128, 64, 128): Triton's block shapes are powers of two
and its dot wants 16 or more along each axis.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.mla import key_segments, tuned
from pallas_kernels.mla.gpu_triton import online_softmax
from pallas_kernels.tuning import lookup


def kernel_dims_fit(*head_dims: int) -> bool:
    """Whether the kernel can take these nope, rope and value head dims (powers of two of at least 16)."""
    return all(d >= 16 and not d & (d - 1) for d in head_dims)


def _segment_kernel(
    first_ref,
    slots_ref,
    valid_ref,
    q_nope_ref,
    q_pe_ref,
    k_nope_ref,
    k_pe_ref,
    v_ref,
    o_in_ref,
    lse_in_ref,
    o_ref,
    lse_ref,
    *,
    scale: float,
    block_k: int,
):
    slots_Q = slots_ref[...]
    first = first_ref[0]
    num_keys = k_nope_ref.shape[0]
    q_nope, q_pe = q_nope_ref[...], q_pe_ref[...]
    dot = functools.partial(plgpu.dot, allow_tf32=q_nope.dtype != jnp.float32)  # fp32 inputs stay exact
    offsets = jnp.arange(block_k)

    def body(i, carry):
        keys = pl.ds(i * block_k, block_k)
        in_segment_K = i * block_k + offsets < num_keys
        rows_K1 = in_segment_K[:, None]
        k_nope = plgpu.load(k_nope_ref.at[keys, :], mask=rows_K1, other=0.0)
        k_pe = plgpu.load(k_pe_ref.at[keys, :], mask=rows_K1, other=0.0)
        v = plgpu.load(v_ref.at[keys, :], mask=rows_K1, other=0.0)
        valid_K = plgpu.load(valid_ref.at[keys], mask=in_segment_K, other=0) != 0
        scores = (dot(q_nope, k_nope, trans_b=True) + dot(q_pe, k_pe, trans_b=True)) * scale
        visible = (first + i * block_k + offsets[None, :] <= slots_Q[:, None]) & valid_K[None, :]
        return online_softmax.add_block(carry, scores, visible, v, dot)

    frontier = jnp.max(slots_Q) - first + 1  # keys past the block's last visible slot are never loaded
    num_blocks = jnp.clip(pl.cdiv(jnp.minimum(frontier, num_keys), block_k), 0, pl.cdiv(num_keys, block_k))
    running = online_softmax.resume(o_in_ref[...], lse_in_ref[...])
    online_softmax.store(o_ref, lse_ref, jax.lax.fori_loop(0, num_blocks, body, running))


def _query_block(length: int, block_q: int) -> int:
    return min(block_q, pl.next_power_of_2(length))


def _padded_queries(q_nope_BTHN, q_pe_BTHP, query_slots_BT, o_BTHV, lse_BTH, block_q: int):
    """The queries and their running attention padded to whole query blocks (pad queries see no key: slot -1,
    zeros and lse -inf); no copy when they are."""
    pad = ((0, 0), (0, -q_nope_BTHN.shape[1] % block_q))
    return (
        jnp.pad(q_nope_BTHN, pad + ((0, 0), (0, 0))),
        jnp.pad(q_pe_BTHP, pad + ((0, 0), (0, 0))),
        jnp.pad(query_slots_BT.astype(jnp.int32), pad, constant_values=-1),
        jnp.pad(o_BTHV, pad + ((0, 0), (0, 0))),
        jnp.pad(lse_BTH, pad + ((0, 0),), constant_values=-jnp.inf),
    )


def nothing_seen(batch: int, length: int, heads: int, value_dim: int):
    """The running attention before any key: (o zeros [B, T, H, V] fp32, lse -inf [B, T, H])."""
    return (
        jnp.zeros((batch, length, heads, value_dim), jnp.float32),
        jnp.full((batch, length, heads), -jnp.inf, jnp.float32),
    )


def attention_segment_gpu(
    q_nope_BTHN,
    q_pe_BTHP,
    k_nope_BSHN,
    k_pe_BSP,
    v_BSHV,
    query_slots_BT,
    key_valid_BS,
    first_slot,
    o_BTHV,
    lse_BTH,
    *,
    scale: float,
    tiles: tuned.PrefillTiles,
    interpret: bool = False,
):
    """The running attention (o [B, T, H, V] fp32, normalised, lse [B, T, H]; zeros and -inf where no key was
    seen, as `nothing_seen`) with the segment's keys (slots first_slot + [0, S); S a power of two) merged in
    exactly, inside the kernel (the running arrays are updated in place). Tiles: block_q, block_k, num_warps,
    num_stages (the segment is the keys')."""
    batch, length, heads, nope = q_nope_BTHN.shape
    segment, value_dim, rope = k_nope_BSHN.shape[1], v_BSHV.shape[-1], q_pe_BTHP.shape[-1]
    if not kernel_dims_fit(nope, rope, value_dim):
        raise ValueError(
            f"the MLA prefill kernel needs nope, rope and value dims that are powers of two >= 16, "
            f"got {nope}, {rope}, {value_dim}"
        )
    block_q = _query_block(length, tiles.block_q)
    block_k = min(tiles.block_k, segment)
    q_nope, q_pe, slots, o_in, lse_in = _padded_queries(
        q_nope_BTHN, q_pe_BTHP, query_slots_BT, o_BTHV, lse_BTH, block_q
    )
    padded = q_nope.shape[1]
    running_specs = [
        pl.BlockSpec((None, block_q, None, value_dim), lambda i, h, b: (b, i, h, 0)),
        pl.BlockSpec((None, block_q, None), lambda i, h, b: (b, i, h)),
    ]
    kernel = functools.partial(_segment_kernel, scale=scale, block_k=block_k)
    o, lse = pl.pallas_call(
        kernel,
        grid=(padded // block_q, heads, batch),
        in_specs=[
            pl.BlockSpec((1,), lambda i, h, b: (0,)),
            pl.BlockSpec((None, block_q), lambda i, h, b: (b, i)),
            pl.BlockSpec((None, segment), lambda i, h, b: (b, 0)),
            pl.BlockSpec((None, block_q, None, nope), lambda i, h, b: (b, i, h, 0)),
            pl.BlockSpec((None, block_q, None, rope), lambda i, h, b: (b, i, h, 0)),
            pl.BlockSpec((None, segment, None, nope), lambda i, h, b: (b, 0, h, 0)),
            pl.BlockSpec((None, segment, rope), lambda i, h, b: (b, 0, 0)),
            pl.BlockSpec((None, segment, None, value_dim), lambda i, h, b: (b, 0, h, 0)),
            *running_specs,
        ],
        out_specs=running_specs,
        out_shape=[jax.ShapeDtypeStruct(o_in.shape, jnp.float32), jax.ShapeDtypeStruct(lse_in.shape, jnp.float32)],
        input_output_aliases={8: 0, 9: 1},
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="mla_prefill_segment",
    )(
        jnp.asarray(first_slot, jnp.int32).reshape(1),
        slots,
        key_valid_BS.astype(jnp.int32),
        q_nope,
        q_pe,
        k_nope_BSHN,
        k_pe_BSP,
        v_BSHV,
        o_in.astype(jnp.float32),
        lse_in.astype(jnp.float32),
    )
    return o[:, :length], lse[:, :length]


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def flash_expanded_attention_gpu(
    q_nope_BTHN,
    q_pe_BTHP,
    latent_BSA,
    query_slots_BT,
    key_valid_BS,
    w_uk_HNR,
    w_uv_HVR,
    *,
    scale: float,
    tiles: tuned.PrefillTiles | None = None,
    interpret: bool = False,
):
    """Expanded MLA attention -> o [B, T, H, V] in q's dtype (arguments as for `flash_expanded_attention`).
    Tiles: None from `tuned.PREFILL`."""
    tiles = tiles or lookup(tuned.PREFILL, dtype=q_nope_BTHN.dtype)
    batch, length, heads, _ = q_nope_BTHN.shape
    latent_dim, value_dim = w_uk_HNR.shape[-1], w_uv_HVR.shape[1]
    dtype = q_nope_BTHN.dtype
    segment = min(tiles.segment, pl.next_power_of_2(latent_BSA.shape[1]))  # Triton block shapes are powers of two
    w_uk, w_uv = w_uk_HNR.astype(dtype), w_uv_HVR.astype(dtype)
    block_q = _query_block(length, tiles.block_q)
    # padded once: the segments then update the running attention in place
    q_nope, q_pe, query_slots, *running = _padded_queries(
        q_nope_BTHN, q_pe_BTHP, query_slots_BT, *nothing_seen(batch, length, heads, value_dim), block_q
    )
    attend = functools.partial(
        attention_segment_gpu,
        scale=scale,
        tiles=dataclasses.replace(tiles, segment=segment, block_q=block_q),
        interpret=interpret,
    )

    def add_segment(first, block_BSA, valid_BS, carry):
        c_kv, k_pe = block_BSA[..., :latent_dim], block_BSA[..., latent_dim:]
        k_nope = jnp.einsum("bsr,hnr->bshn", c_kv, w_uk)
        v = jnp.einsum("bsr,hvr->bshv", c_kv, w_uv)
        return attend(q_nope, q_pe, k_nope, k_pe, v, query_slots, valid_BS, first, *carry)

    latent = latent_BSA.astype(dtype)
    o, _ = key_segments.walk(latent, key_valid_BS, query_slots, segment, add_segment, tuple(running))
    return o[:, :length].astype(dtype)
