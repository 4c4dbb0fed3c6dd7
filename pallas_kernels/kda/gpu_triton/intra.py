"""KDA prefill on GPU, phase 1 of 2: everything inside a 64-token chunk, three Pallas kernels (Triton lowering),
all programs of each independent, handing intermediates over in global memory:

1. `blocks.sub_block_keys`, grid (B*H, T/16): each 16-row sub-block's keys decayed to its end and its
   gate totals (what the next kernel needs of the sub-blocks other than a program's own).
   `blocks.decay_blocks`, grid (B*H, T/64, 4): per 16-row sub-block i of a chunk, its rows of
   qg = e^G q, of the decay-weighted products a_qk (both parts) and of L = diag(beta) A_kk: the blocks L_ij,
   j < i, and the inverse D_i = (I + L_ii)^-1 of its diagonal block, by row updates in registers; and the
   decayed keys kb = beta e^G k, kg = e^{G_last - G} k, decay_last.
2. `tril.wy_factors`, grid (B*H, T/64): X = (I + L)^-1 ([64, 64], as 16x16 blocks in registers)
   from the D_i and L_ij, then w = X kb and u = X (beta v), by 16x16 x 16xK products.
(Phase 1 with programs that own whole chunks, for gates >= -5: `pallas_kernels.experimental.kda_fused`.)
Short programs, many of them: the first single kernel ran one long chain of 16x16 products per chunk (15 of
them for the forward substitution alone), with few programs resident per SM to hide its latency.

Exponentials cannot overflow fp32: each is of a log-decay difference that is <= 0, except inside a diagonal
16x16 block, where e^{-Γ} <= e^80 for gates >= -5 (16 steps); with any_gate (the variant gpu_triton_any_gate)
that block is formed from running products of per-step decays instead, for gates of any size; see the kernels'
docstrings. Products: tf32 for
bf16/fp16 inputs (whose own rounding is larger), IEEE fp32 for fp32 inputs (`gpu_dots`); no product has two
operands that are inputs as given, so none runs on bf16 operands without rounding an fp32 factor to bf16.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax

from pallas_kernels.kda import tuned
from pallas_kernels.kda.gpu_triton.blocks import decay_blocks, intra_tiles, sub_block_keys
from pallas_kernels.kda.gpu_triton.tril import CHUNK, gpu_dots, wy_factors

__all__ = ["CHUNK", "ChunkParts", "PairedParts", "gpu_dots", "intra_chunk", "intra_chunk_any_gate"]


class ChunkParts(NamedTuple):
    """Phase 1's output, per sequence-head (BH = B*H, Tp = T padded to whole chunks, N = Tp / CHUNK)."""

    w: jax.Array  # [BH, Tp, K] T (e^G k), T = (I + L)^-1 diag(beta)
    u: jax.Array  # [BH, Tp, V] T v
    qg: jax.Array  # [BH, Tp, K] e^G q
    kg: jax.Array  # [BH, Tp, K] e^{G_last - G} k
    a_qk: jax.Array  # [BH, Tp, CHUNK] sum_i q_c k_s e^{G_c - G_s} for s <= c, else 0
    decay_last: jax.Array  # [BH, N, 1, K] fp32 e^{G_last}


class PairedParts(NamedTuple):
    """Phase 1's output for the paired state pass (`short_chunks`, `tuned.ShortChunkTiles.paired`): the output's
    product with the state folded into one with w, o = qg S + a_qk (u - w S) = (qg - a_qk w) S + a_qk u, and the
    rows of each pair interleaved (row 2r of a chunk's 2C rows its row r of the first, 2r + 1 of the second), so
    that one product of the state with a chunk's wq gives both, and adding ua takes both sums at once."""

    wq: jax.Array  # [BH, 2 Tp, K] (w, qg - a_qk w), rows interleaved
    ua: jax.Array  # [BH, 2 Tp, V] (u, a_qk u), rows interleaved
    kg: jax.Array  # [BH, Tp, K] e^{G_last - G} k
    decay_last: jax.Array  # [BH, N, 1, K] fp32 e^{G_last}


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "parts_dtype", "tiles", "any_gate", "interpret"))
def intra_chunk(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale: float,
    use_qk_l2norm: bool = True,
    parts_dtype=None,
    tiles: tuned.IntraTiles | None = None,
    any_gate: bool = False,
    interpret: bool = False,
) -> ChunkParts:
    """Phase 1 over whole chunks: q, k [B, Tp, H, K], v [B, Tp, H, V], g [B, Tp, H, K] fp32 log-decay,
    beta [B, Tp, H, 1] fp32, Tp a multiple of CHUNK; parts stored as parts_dtype (default v's).
    The keys and block-row kernels work through the keys block_k columns at a time with num_warps Triton warps
    and num_stages stages; the WY-factors kernel has factors_num_warps and num_stages. Tiles: None from
    `tuned.CHUNK_INTRA` (`tuned.CHUNK_INTRA_ANY_GATE` with any_gate: gates below -5 allowed, `blocks`' module
    docstring)."""
    dtype = v.dtype if parts_dtype is None else parts_dtype
    tiles = tiles or intra_tiles(v.dtype, any_gate)
    options = dict(use_qk_l2norm=use_qk_l2norm, parts_dtype=dtype, tiles=tiles, any_gate=any_gate, interpret=interpret)
    right, totals = sub_block_keys(k, g, **options)
    qg, a_qk, blocks, kb, kg, decay_last = decay_blocks(q, k, g, beta, right, totals, scale=scale, **options)
    w, u = wy_factors(blocks, kb, v, beta, parts_dtype=dtype, input_dtype=v.dtype, tiles=tiles, interpret=interpret)
    return ChunkParts(w, u, qg, kg, a_qk, decay_last)


# phase 1 for log-decays of any size (the variant gpu_triton_any_gate); one object, so that jit sees one static value
intra_chunk_any_gate = functools.partial(intra_chunk, any_gate=True)
