"""KDA chunked prefill on GPU: two phases of Pallas kernels (Triton lowering) over 64-token chunks, as in FLA.

1. `intra.intra_chunk` (three pallas_calls, each over independent programs): per chunk the
   decay-weighted q-k and k-k blocks, the inverse of (I + L), the WY factors w = T (e^G k), u = T v and the
   decayed q and k (no exponential can overflow fp32: for gates >= -5 in `chunk_kda_gpu`, for any gate in
   `chunk_kda_gpu_any_gate`, whose diagonal 16x16 blocks are formed from running products of per-step decays);
   or, for gates >= -5, `chunk_kda_gpu_fused`: the same parts from one pallas_call (or two) whose programs work
   on whole chunks (`intra.Phase1`).
2. `inter.inter_chunk`, grid (V/block_v, B*H), one program walks the chunks in order, carrying its
   slice of the fp32 state and writing the output.
Both read and write the [B, T, H, ...] layout directly; T is padded to whole chunks (g = 0, beta = 0: an
identity update) only when it is not already a multiple of 64.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda import tuned
from pallas_kernels.kda.gpu_triton.inter import inter_chunk
from pallas_kernels.kda.gpu_triton.intra import CHUNK, Phase1, intra_chunk
from pallas_kernels.tuning import fill, lookup


def _pad_time(x, pad: int):
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "use_qk_l2norm",
        "parts_dtype",
        "block_v",
        "num_warps",
        "num_stages",
        "intra_block_k",
        "intra_num_warps",
        "intra_num_stages",
        "intra_factors_num_warps",
        "any_gate",
        "phase1",
        "interpret",
    ),
)
def chunk_kda_gpu(
    q,
    k,
    v,
    g,
    beta,
    initial_state=None,
    *,
    scale: float,
    use_qk_l2norm: bool = True,
    parts_dtype=None,
    block_v: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    intra_block_k: int | None = None,
    intra_num_warps: int | None = None,
    intra_num_stages: int | None = None,
    intra_factors_num_warps: int | None = None,
    any_gate: bool = False,
    phase1: Phase1 = Phase1.THREE_KERNELS,
    interpret: bool = False,
):
    """(o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32) for log-decays g >= -5
    (`chunk_math.GATE_FLOOR`); with any_gate (`chunk_kda_gpu_any_gate`) for any g <= 0.

    The inputs are padded to whole chunks, phase 1 (`intra_chunk`, its kernels `phase1`) gives their
    `ChunkParts`, phase 2 (`inter_chunk`) carries the state. parts_dtype: how phase 1 hands its per-chunk
    factors to phase 2 (default v's dtype; jnp.float32 with bf16 inputs keeps tf32 precision in phase 2 for
    twice the memory traffic). block_v, num_warps, num_stages tile the sequential phase; the intra_* knobs are
    `intra_chunk`'s (the parallel phase). None: `tuned.CHUNK_INTER` / phase 1's table (`intra_chunk`).
    """
    batch, length, heads, key_dim = q.shape
    pad = -length % CHUNK
    q, k, v, g, beta = (
        _pad_time(x, pad) for x in (q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32)[..., None])
    )
    if initial_state is None:
        initial_state = jnp.zeros((batch, heads, key_dim, v.shape[-1]), jnp.float32)
    block_v, num_warps, num_stages = fill((block_v, num_warps, num_stages), lookup(tuned.CHUNK_INTER, dtype=v.dtype))
    parts = intra_chunk(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        parts_dtype=parts_dtype,
        block_k=intra_block_k,
        num_warps=intra_num_warps,
        num_stages=intra_num_stages,
        factors_num_warps=intra_factors_num_warps,
        any_gate=any_gate,
        form=phase1,
        interpret=interpret,
    )
    o, state = inter_chunk(
        parts,
        initial_state.astype(jnp.float32),
        out_dtype=v.dtype,
        block_v=block_v,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
    )
    return o[:, :length], state


def chunk_kda_gpu_any_gate(q, k, v, g, beta, initial_state=None, **options):
    """`chunk_kda_gpu` for log-decays g <= 0 of any size (e.g. -A softplus(a) without the safe gate); options: its
    keywords, phase 1's tiles from `tuned.CHUNK_INTRA_ANY_GATE` when None."""
    return chunk_kda_gpu(q, k, v, g, beta, initial_state, any_gate=True, **options)


def chunk_kda_gpu_fused(q, k, v, g, beta, initial_state=None, *, one_kernel: bool = True, **options):
    """`chunk_kda_gpu` (log-decays g >= -5) with phase 1 over whole chunks, in one pallas_call (the variant
    gpu_triton_fused) or, without one_kernel, two (gpu_triton_fused_wy); options: its keywords, phase 1's tiles
    from `tuned.CHUNK_FUSED` / `CHUNK_FUSED_WY` when None."""
    return chunk_kda_gpu(q, k, v, g, beta, initial_state, phase1=Phase1.fused(one_kernel), **options)
