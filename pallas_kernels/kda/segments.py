"""Segment-parallel KDA prefill: one long sequence split over `segments` pieces that the chunk kernel runs as a
batch, so a GPU whose B x H sequence-heads leave most of its SMs idle (B=1, H=8: one GPU's share under tensor=8)
runs them all.

The recurrence is linear in the state. Over a segment, S_after = A S_before + S_local with A [K, K] (the
segment's state transition) and S_local [K, V] (its state from a zero start), both of the segment's own q, k, v,
g, beta; every state inside it is S_t = A_t S_before + S_local,t (A_t: the transition up to token t) and so
every output o_t = S_t^T q_t = S_before^T (A_t^T q_t) + o_local,t. Values enter linearly, so the chunk kernel
run on the augmented values [0_K | v] (V' = K + V) from the state [I_K | 0] returns [A_t^T q_t | o_local,t] as its
output and [A | S_local] as its final state (the GPU kernels take the zero columns as such: their phase 1, which
does not depend on the state, forms v's columns only; the others are given them). One run of the kernel over
the segments as a batch gives all of them; a serial scan over the few segments gives each one's incoming state
(S_in(s+1) = A_s S_in(s) + S_local_s, from the call's initial state; the last is the sequence's final state) and
one batched product adds S_in^T (A_t^T q_t) to every output. Every variant of `chunk_kda` (bounded, any-gate, GPU,
TPU, reference) runs it.

The sequence is padded to `segments` x a whole number of 64-token chunks with identity tokens (q = k = v = 0,
g = 0, beta = 0: the kernels' own chunk padding, and l2norm(0) = 0), which leave the state as it is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SEGMENT_ALIGN = 64  # segment lengths are whole 64-token chunks: the GPU kernels' chunk (the TPU's 16 divides it)
MIN_SEGMENT_TOKENS = 2048  # shorter segments: the per-call cost (phase 1, the scan, the product) outweighs the split
MIN_SEGMENTS = 4  # fewer: the kernel's twice-wide values (V' = K + V) eat the gain
STATE_COLUMNS = 64  # value columns of the state a program of the GPU state pass holds (tuned.CHUNK_INTER_SHORT)
PROGRAMS_PER_CORE = 2  # state-pass programs resident on an SM at once (239 registers x 128 threads, 40 KiB smem)


def segment_count(batch: int, heads: int, length: int, cores: int | None, width: int = 256) -> int:
    """How many segments `chunk_kda(segments=None)` splits a sequence into: the state pass's programs (B x H x
    segments x width / STATE_COLUMNS, width = K + V the augmented values' columns) fill the device's cores once,
    PROGRAMS_PER_CORE to a core, each segment of at least MIN_SEGMENT_TOKENS tokens; 1 (unsplit) below
    MIN_SEGMENTS, where the kernel's doubled value width eats the gain, and where `cores` is None (no GPU: a TPU
    runs the kernel's grid in order, a CPU the reference). On an H100 (132 SMs) at B=1 T=32768 H=8, 8 segments
    took 1.39 ms against 1.49 at 16 (the SMs once over by sequence-heads alone, the rule before), 1.62 at 4
    (docs/benchmarks/kda.md#two-warps-a-program-for-phase-1-2026-12-06-twenty-fourth-session)."""
    if cores is None:
        return 1
    programs = batch * heads * -(-width // STATE_COLUMNS)
    count = min(PROGRAMS_PER_CORE * cores // programs, length // MIN_SEGMENT_TOKENS)
    return count if count >= MIN_SEGMENTS else 1


def segment_length(length: int, segments: int) -> int:
    """The tokens of each segment: length / segments rounded up to whole SEGMENT_ALIGN-token chunks."""
    return -(-length // (segments * SEGMENT_ALIGN)) * SEGMENT_ALIGN


def _as_segments(x, count: int, size: int):
    """[B, T, ...] -> [B * count, size, ...], the tail padded with zeros."""
    batch, length = x.shape[:2]
    padded = jnp.pad(x, [(0, 0), (0, count * size - length)] + [(0, 0)] * (x.ndim - 2))
    return padded.reshape(batch * count, size, *x.shape[2:])


def segmented_chunk_kda(chunk, q, k, v, g, beta, initial_state, segments: int, combine=None):
    """(o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32): `chunk` over `segments` pieces of each
    sequence at once (the module's docstring). chunk(q, k, v, g, beta, initial_state, identity_columns=0) -> (o,
    final state): a chunk_kda variant with its keywords bound, on the values [0_identity_columns | v]. Arrays as
    `chunk_kda`'s, initial_state [B, H, K, V] fp32; the segments are whole 64-token chunks (`segment_length`), so
    fewer run where T is short. combine: `combine_reference`'s signature (None: it), the last step's kernel."""
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    size = segment_length(length, segments)
    count = -(-length // size)
    if count == 1:
        return chunk(q, k, v, g, beta, initial_state)
    q_NLHK, k_NLHK, v_NLHV, g_NLHK, beta_NLH = (_as_segments(x, count, size) for x in (q, k, v, g, beta))
    identity_NHKW = jnp.broadcast_to(  # W = K + V: the values [0_K | v]
        jnp.eye(key_dim, key_dim + value_dim, dtype=jnp.float32), (batch * count, heads, key_dim, key_dim + value_dim)
    )
    o_NLHW, state_NHKW = chunk(q_NLHK, k_NLHK, v_NLHV, g_NLHK, beta_NLH, identity_NHKW, identity_columns=key_dim)
    state_SBHKW = jnp.moveaxis(state_NHKW.reshape(batch, count, heads, key_dim, -1), 1, 0)
    transition_SBHKK, local_SBHKV = state_SBHKW[..., :key_dim], state_SBHKW[..., key_dim:]

    def advance(state_BHKV, segment):
        transition_BHKK, local_BHKV = segment
        after_BHKV = jnp.einsum("bhij,bhjv->bhiv", transition_BHKK, state_BHKV, precision=jax.lax.Precision.HIGHEST)
        return after_BHKV + local_BHKV, state_BHKV

    # unrolled: a few small products, where a GPU while loop would wait on the host each step
    final_BHKV, incoming_SBHKV = jax.lax.scan(advance, initial_state, (transition_SBHKK, local_SBHKV), unroll=True)
    incoming_NHKV = jnp.moveaxis(incoming_SBHKV, 0, 1).reshape(batch * count, heads, key_dim, value_dim)
    o_NLHV = (combine or combine_reference)(o_NLHW, incoming_NHKV)
    return o_NLHV.reshape(batch, count * size, heads, value_dim)[:, :length], final_BHKV


def combine_reference(o_NLHW, incoming_NHKV):
    """o [N, L, H, V] in o's dtype, o_local,t + S_in^T (A_t^T q_t), from the chunk kernel's [A_t^T q_t | o_local,t]
    [N, L, H, K + V] and each piece's incoming state [N, H, K, V] fp32, under XLA (products at the device's
    default precision for 16-bit outputs, exact for fp32 ones); the GPU's kernel is
    `gpu_triton.combine.combine_segments_gpu`."""
    key_dim = incoming_NHKV.shape[-2]
    exact = o_NLHW.dtype == jnp.float32
    carried_NLHV = jnp.einsum(
        "nlhk,nhkv->nlhv",
        o_NLHW[..., :key_dim].astype(jnp.float32),
        incoming_NHKV,
        precision=jax.lax.Precision.HIGHEST if exact else None,
    )
    return (o_NLHW[..., key_dim:].astype(jnp.float32) + carried_NLHV).astype(o_NLHW.dtype)
