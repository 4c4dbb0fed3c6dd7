"""KDA prefill on GPU over 16-token chunks (or 32: `tuned.ShortChunkTiles.chunk`): phase 1 as one token-parallel
Pallas kernel (Triton lowering), the variant gpu_triton_short (gates >= -5), phase 2 the default's state pass
(`inter.inter_chunk`) over the same chunks.

The default works in 64-token chunks, whose phase 1 needs the inverse of a 64 x 64 unit lower-triangular matrix
(three kernels, latency-bound: docs/benchmarks/kda.md). With C = 16-token chunks, as FlashKDA does, each chunk's
parts come from its own C rows, a few [C, K] x [K, C] and C x C products in one program:

- G = the chunk's cumulative log-decay (row c: the sum of its gates up to c); within each 16-row block, R = G at
  the block's row 7 (the reference): A_kk = (k e^{G - R}) (k e^{R - G})^T below the diagonal, a_qk =
  (q e^{G - R}) (k e^{R - G})^T on and below it. Each factor's exponent lies within 8 gates of 0 on one side and
  9 on the other: for gates >= -5 within [-45, 45], where fp32 neither overflows nor underflows (above the
  diagonal the products reach e^80, still finite, and are masked). At C = 32 the second block's rows against the
  first's columns are taken against row 15, both factors decays (<= 1): one reference for 32 rows would put
  factors of e^{-80} against e^{+80}, whose small side a flush of denormals to zero loses.
- X = (I + L)^-1 for L = diag(beta) A_kk, strictly lower-triangular (nilpotent: L^16 = 0), as the Neumann
  product (I - L)(I + L^2)(I + L^4)(I + L^8): three squarings and three products, IEEE fp32; at C = 32 per
  16-row block, and X_10 = -X_11 L_10 X_00 below them.
- w = X (beta e^G k), u = X (beta v), qg = e^G q, kg = e^{G_last - G} k, decay_last = e^{G_last}: the parts of
  `intra.ChunkParts` at C rows a chunk (a_qk [BH, Tp, C]).

With tiles.paired (16-token chunks; lab) the parts are `intra.PairedParts`: o's product with the state folded into
w's (qg - a_qk w; a_qk u formed here), the pairs' rows interleaved, so that the state pass makes two products a
step where it made four (sm_90: 8 m64n32k16 + 1 m64n128k16 wgmma in 2 waited groups, against 17 m64n16k16 + 1 in
4), and phase 1 two more [16, 16] x [16, K] products a chunk.

Program (sequence-head, group) owns `chunks` consecutive chunks (tiles: `tuned.CHUNK_SHORT`), taken in turn.
Phase 2 then walks 64 / C times as many chunks as the default, each step that much less work, with the state held
transposed (`tuned.CHUNK_INTER_SHORT`: state_rows), so that its products keep 64 state rows on the tensor cores'
M side rather than a chunk's C tokens. Products as `tril.gpu_dots`:
tf32 for bf16 / fp16 inputs, IEEE fp32 for fp32 inputs (the gate sums and the inverse always IEEE fp32).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda import tuned
from pallas_kernels.kda.gpu_triton.blocks import EXACT_DOT, inverse_norms
from pallas_kernels.kda.gpu_triton.chunk import chunk_kda_gpu
from pallas_kernels.kda.gpu_triton.intra import ChunkParts, PairedParts
from pallas_kernels.kda.gpu_triton.tril import SUB, gpu_dots, iota_16
from pallas_kernels.tuning import lookup

SHORT_CHUNK = SUB  # the default chunk: tril's 16-row blocks
CHUNK_SIZES = (16, 32)  # `tuned.ShortChunkTiles.chunk`: one or two 16-row blocks of decay factors


def neumann_inverse(strict_L):
    """(I + L)^-1 for L [16, 16] strictly lower-triangular fp32: (I - L)(I + L^2)(I + L^4)(I + L^8)."""
    inverse, power = (iota_16(0) == iota_16(1)).astype(jnp.float32) - strict_L, strict_L
    for _ in range(3):
        power = EXACT_DOT(power, power)
        inverse = inverse + EXACT_DOT(inverse, power)
    return inverse


class _Block(NamedTuple):
    """A 16-row block's factors: R its cumulative log-decay at its row 7 from the chunk's start [1, K] (the
    reference), total its gates' sum [1, K], left = e^{G - R}, right = k e^{R - G} (G the cumulative log-decays),
    q and k normalised (q scaled), beta [16, 1]."""

    R: jax.Array
    total: jax.Array
    left: jax.Array
    right: jax.Array
    q: jax.Array
    k: jax.Array
    beta: jax.Array


def _block(q_ref, k_ref, g_ref, beta_ref, rows, offset_1K=None, *, scale, l2norm) -> _Block:
    """The block of `rows` (16), offset_1K the log-decay summed over the chunk's rows before it (None: none):
    factors within e^{+-45} for gates >= -5 (two exponentials a token-channel)."""
    g_CK = g_ref[rows, :]
    row_CK = jax.lax.broadcasted_iota(jnp.int32, g_CK.shape, 0)
    G_CK = jnp.cumsum(g_CK, axis=0)
    reference_1K = jnp.sum(jnp.where(row_CK <= SUB // 2 - 1, g_CK, 0.0), axis=0, keepdims=True)
    left_CK, inverse_left_CK = jnp.exp(G_CK - reference_1K), jnp.exp(reference_1K - G_CK)
    k_CK = k_ref[rows, :].astype(jnp.float32)
    k_CK = k_CK * inverse_norms([k_CK], l2norm)
    q_CK = q_ref[rows, :].astype(jnp.float32)
    q_CK = q_CK * (inverse_norms([q_CK], l2norm) * scale)
    total_1K = jnp.sum(g_CK, axis=0, keepdims=True)
    if offset_1K is not None:
        reference_1K = reference_1K + offset_1K
    return _Block(reference_1K, total_1K, left_CK, k_CK * inverse_left_CK, q_CK, k_CK, beta_ref[rows, :])


def _block_parts(b: _Block, rows, total_1K, dots, kg_ref, put):
    """A block's own parts: kg stored, put(a_qk block, qg) (as formed: the callers store them), (X_jj = (I +
    L_jj)^-1, beta e^G k) returned."""
    rows_CC, cols_CC = iota_16(0), iota_16(1)
    kg_ref[rows, :] = (jnp.exp(total_1K - b.R) * b.right).astype(kg_ref.dtype)
    a_kk_CC, a_qk_CC = dots.nt(b.k * b.left, b.right), dots.nt(b.q * b.left, b.right)
    decay_CK = b.left * jnp.exp(b.R)
    put(jnp.where(cols_CC <= rows_CC, a_qk_CC, 0.0), decay_CK * b.q)
    inverse_CC = neumann_inverse(jnp.where(cols_CC < rows_CC, b.beta * a_kk_CC, 0.0))
    return inverse_CC, b.beta * decay_CK * b.k


def _storer(rows, qg_ref, a_ref, a_columns):
    """`_block_parts`' put for the parts as `intra.ChunkParts` holds them: the a_qk block at `a_columns` of a_ref,
    qg at its rows."""

    def put(a_qk_CC, qg_CK):
        a_ref[rows, a_columns] = a_qk_CC.astype(a_ref.dtype)
        qg_ref[rows, :] = qg_CK.astype(qg_ref.dtype)

    return put


def _kernel(
    q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, qg_ref, kg_ref, a_ref, decay_ref, *, scale, l2norm, input_dtype
):
    """16-token chunks: one block a chunk."""
    dots = gpu_dots(input_dtype)
    for c in range(decay_ref.shape[0]):  # each part stored once formed, so that few tiles are alive at once
        rows = pl.ds(c * SUB, SUB)
        b = _block(q_ref, k_ref, g_ref, beta_ref, rows, scale=scale, l2norm=l2norm)
        decay_ref[c] = jnp.exp(b.total)
        inverse_CC, decayed_keys_CK = _block_parts(
            b, rows, b.total, dots, kg_ref, _storer(rows, qg_ref, a_ref, slice(None))
        )
        w_ref[rows, :] = dots.nn(inverse_CC, decayed_keys_CK).astype(w_ref.dtype)
        u_ref[rows, :] = dots.nn(inverse_CC, b.beta * v_ref[rows, :].astype(jnp.float32)).astype(u_ref.dtype)


def _kernel_paired(
    q_ref, k_ref, v_ref, g_ref, beta_ref, wq_ref, ua_ref, kg_ref, decay_ref, *, scale, l2norm, input_dtype
):
    """16-token chunks, the parts as `intra.PairedParts`: wq [C, 2, K] holds (w, qg - a_qk w), ua [C, 2, V]
    (u, a_qk u), both products in fp32 from w and u before they are rounded."""
    dots = gpu_dots(input_dtype)
    for c in range(decay_ref.shape[0]):
        rows = pl.ds(c * SUB, SUB)
        b = _block(q_ref, k_ref, g_ref, beta_ref, rows, scale=scale, l2norm=l2norm)
        decay_ref[c] = jnp.exp(b.total)
        formed = []
        inverse_CC, decayed_keys_CK = _block_parts(b, rows, b.total, dots, kg_ref, lambda *parts: formed.extend(parts))
        a_qk_CC, qg_CK = formed
        w_CK = dots.nn(inverse_CC, decayed_keys_CK)
        wq_ref[rows, 0, :] = w_CK.astype(wq_ref.dtype)
        wq_ref[rows, 1, :] = (qg_CK - dots.nn(a_qk_CC, w_CK)).astype(wq_ref.dtype)
        u_CV = dots.nn(inverse_CC, b.beta * v_ref[rows, :].astype(jnp.float32))
        ua_ref[rows, 0, :] = u_CV.astype(ua_ref.dtype)
        ua_ref[rows, 1, :] = dots.nn(a_qk_CC, u_CV).astype(ua_ref.dtype)


def _kernel_pairs(
    q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, qg_ref, kg_ref, a_ref, decay_ref, *, scale, l2norm, input_dtype
):
    """32-token chunks as two 16-row blocks (loaded apart): each block's own parts as the 16-token kernel's;
    block 1's rows against block 0's columns taken against row 15 (both factors decays: the blocks' factors
    times per-block ones); X = (I + L)^-1 by blocks, X_10 = -X_11 L_10 X_00."""
    dots = gpu_dots(input_dtype)
    for c in range(decay_ref.shape[0]):
        rows = [pl.ds(c * 2 * SUB + j * SUB, SUB) for j in range(2)]
        first = _block(q_ref, k_ref, g_ref, beta_ref, rows[0], scale=scale, l2norm=l2norm)  # first.total: G at row 15
        second = _block(q_ref, k_ref, g_ref, beta_ref, rows[1], first.total, scale=scale, l2norm=l2norm)
        total_1K = first.total + second.total
        decay_ref[c] = jnp.exp(total_1K)
        cross_left_CK = second.left * jnp.exp(second.R - first.total)  # e^{G - G_15}, block 1
        cross_right_CK = first.right * jnp.exp(first.total - first.R)  # k e^{G_15 - G}, block 0
        cross_kk_CC = dots.nt(second.k * cross_left_CK, cross_right_CK)
        a_ref[rows[1], pl.ds(0, SUB)] = dots.nt(second.q * cross_left_CK, cross_right_CK).astype(a_ref.dtype)
        a_ref[rows[0], pl.ds(SUB, SUB)] = jnp.zeros((SUB, SUB), a_ref.dtype)
        (inverse_0, keys_0), (inverse_1, keys_1) = (
            _block_parts(b, rows[j], total_1K, dots, kg_ref, _storer(rows[j], qg_ref, a_ref, pl.ds(j * SUB, SUB)))
            for j, b in enumerate((first, second))
        )
        below_CC = -EXACT_DOT(inverse_1, EXACT_DOT(second.beta * cross_kk_CC, inverse_0))  # X_10
        values_0, values_1 = (b.beta * v_ref[rows[j], :].astype(jnp.float32) for j, b in enumerate((first, second)))
        for out_ref, part_0, part_1 in ((w_ref, keys_0, keys_1), (u_ref, values_0, values_1)):
            out_ref[rows[0], :] = dots.nn(inverse_0, part_0).astype(out_ref.dtype)
            out_ref[rows[1], :] = (dots.nn(below_CC, part_0) + dots.nn(inverse_1, part_1)).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "parts_dtype", "tiles", "interpret"))
def short_chunk_parts(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale: float,
    use_qk_l2norm: bool = True,
    parts_dtype=None,
    tiles: tuned.ShortChunkTiles | None = None,
    interpret: bool = False,
) -> ChunkParts | PairedParts:
    """Phase 1 over C-token chunks (module docstring; C = tiles.chunk), `intra.intra_chunk`'s signature: q, k
    [B, Tp, H, K], v [B, Tp, H, V], g [B, Tp, H, K] fp32 log-decays >= -5, beta [B, Tp, H, 1] fp32, Tp a multiple
    of C; parts in parts_dtype (default v's), a_qk [BH, Tp, C], decay_last [BH, Tp / C, 1, K]; with tiles.paired
    (16-token chunks) as `intra.PairedParts`. Grid (B*H, Tp / (C x chunks)), chunks the largest power of two <=
    tiles.chunks dividing Tp / C. Tiles: None from `tuned.CHUNK_SHORT`."""
    tiles = tiles or lookup(tuned.CHUNK_SHORT, dtype=v.dtype)
    dtype = v.dtype if parts_dtype is None else parts_dtype
    batch, padded, heads, key_dim = q.shape
    size = tiles.chunk
    if size not in CHUNK_SIZES:
        raise ValueError(f"short_chunk_parts: chunks of {size} tokens, expected one of {CHUNK_SIZES}")
    if padded % size:
        raise ValueError(f"short_chunk_parts: {padded} tokens, expected a multiple of {size}")
    if tiles.paired and size != SUB:
        raise ValueError(f"short_chunk_parts: paired parts take {SUB}-token chunks, got {size}")
    chunks = tiles.chunks
    while (padded // size) % chunks:
        chunks //= 2
    value_dim, flat, span = v.shape[-1], batch * heads, size * chunks
    rows = lambda width: pl.BlockSpec((None, span, None, width), lambda bh, n: (bh // heads, n, bh % heads, 0))  # noqa: E731
    out_rows = lambda width: pl.BlockSpec((None, span, width), lambda bh, n: (bh, n, 0))  # noqa: E731
    inputs = [rows(key_dim), rows(key_dim), rows(value_dim), rows(key_dim), rows(1)]
    decay_spec = pl.BlockSpec((None, chunks, 1, key_dim), lambda bh, n: (bh, n, 0, 0))
    decay_shape = jax.ShapeDtypeStruct((flat, padded // size, 1, key_dim), jnp.float32)
    call = functools.partial(
        pl.pallas_call,
        grid=(flat, padded // span),
        in_specs=inputs,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret,
        name="kda_prefill_short_chunks",
    )
    options = dict(scale=scale, l2norm=use_qk_l2norm, input_dtype=v.dtype)
    if tiles.paired:
        pairs = lambda width: pl.BlockSpec((None, span, 2, width), lambda bh, n: (bh, n, 0, 0))  # noqa: E731
        wq, ua, kg, decay_last = call(
            functools.partial(_kernel_paired, **options),
            out_specs=[pairs(key_dim), pairs(value_dim), out_rows(key_dim), decay_spec],
            out_shape=[
                jax.ShapeDtypeStruct((flat, padded, 2, key_dim), dtype),
                jax.ShapeDtypeStruct((flat, padded, 2, value_dim), dtype),
                jax.ShapeDtypeStruct((flat, padded, key_dim), dtype),
                decay_shape,
            ],
        )(q, k, v, g, beta)
        return PairedParts(
            wq.reshape(flat, 2 * padded, key_dim), ua.reshape(flat, 2 * padded, value_dim), kg, decay_last
        )
    parts = call(
        functools.partial(_kernel if size == SUB else _kernel_pairs, **options),
        out_specs=[
            out_rows(key_dim),
            out_rows(value_dim),
            out_rows(key_dim),
            out_rows(key_dim),
            out_rows(size),
            decay_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((flat, padded, key_dim), dtype),
            jax.ShapeDtypeStruct((flat, padded, value_dim), dtype),
            jax.ShapeDtypeStruct((flat, padded, key_dim), dtype),
            jax.ShapeDtypeStruct((flat, padded, key_dim), dtype),
            jax.ShapeDtypeStruct((flat, padded, size), dtype),
            decay_shape,
        ],
    )(q, k, v, g, beta)
    return ChunkParts(*parts)


def chunk_kda_gpu_short(q, k, v, g, beta, initial_state=None, *, tiles: tuned.ChunkTiles | None = None, **options):
    """`chunk_kda_gpu` over 16-token chunks (or tiles.intra.chunk; the variant gpu_triton_short, gates >= -5): phase 1
    `short_chunk_parts`, phase 2 `inter.inter_chunk`. options: chunk_kda_gpu's keywords (tiles.intra a
    `tuned.ShortChunkTiles`, None from `tuned.CHUNK_SHORT`; tiles.inter None from `tuned.CHUNK_INTER_SHORT`)."""
    tiles = tiles or tuned.ChunkTiles()
    if tiles.inter is None:
        tiles = dataclasses.replace(tiles, inter=lookup(tuned.CHUNK_INTER_SHORT, dtype=v.dtype))
    return chunk_kda_gpu(q, k, v, g, beta, initial_state, phase1=short_chunk_parts, tiles=tiles, **options)
