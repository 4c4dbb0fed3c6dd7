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
- X = (I + L)^-1 for L = diag(beta) A_kk, strictly lower-triangular (nilpotent: L^C = 0), as the Neumann
  product (I - L)(I + L^2)(I + L^4)(I + L^8) (and (I + L^16) at C = 32): squarings and products in IEEE fp32.
- w = X (beta e^G k), u = X (beta v), qg = e^G q, kg = e^{G_last - G} k, decay_last = e^{G_last}: the parts of
  `intra.ChunkParts` at C rows a chunk (a_qk [BH, Tp, C]).

Program (sequence-head, group) owns `chunks` consecutive chunks (tiles: `tuned.CHUNK_SHORT`), taken in turn.
Phase 2 then walks 64 / C times as many chunks as the default, each step that much less work, with the state held
transposed (`tuned.CHUNK_INTER_SHORT`: state_rows), so that its products keep 64 state rows on the tensor cores'
M side rather than a chunk's C tokens. Products as `tril.gpu_dots`:
tf32 for bf16 / fp16 inputs, IEEE fp32 for fp32 inputs (the gate sums and the inverse always IEEE fp32).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda import tuned
from pallas_kernels.kda.gpu_triton.blocks import EXACT_DOT, inverse_norms
from pallas_kernels.kda.gpu_triton.chunk import chunk_kda_gpu
from pallas_kernels.kda.gpu_triton.intra import ChunkParts
from pallas_kernels.kda.gpu_triton.tril import SUB, gpu_dots
from pallas_kernels.tuning import lookup

SHORT_CHUNK = SUB  # the default chunk: tril's 16-row blocks
CHUNK_SIZES = (16, 32)  # `tuned.ShortChunkTiles.chunk`: one or two 16-row blocks of decay factors


def _iota(size: int, axis: int):
    return jax.lax.broadcasted_iota(jnp.int32, (size, size), axis)


def neumann_inverse(strict_L):
    """(I + L)^-1 for L [C, C] strictly lower-triangular fp32, C a power of two: (I - L)(I + L^2)(I + L^4)...
    (I + L^{C/2}) (L^C = 0)."""
    size = strict_L.shape[0]
    inverse, power = (_iota(size, 0) == _iota(size, 1)).astype(jnp.float32) - strict_L, strict_L
    for _ in range(size.bit_length() - 2):
        power = EXACT_DOT(power, power)
        inverse = inverse + EXACT_DOT(inverse, power)
    return inverse


def _kernel(
    q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, qg_ref, kg_ref, a_ref, decay_ref, *, scale, l2norm, input_dtype
):
    dots = gpu_dots(input_dtype)
    size = a_ref.shape[-1]  # tokens a chunk
    rows_CC, cols_CC = _iota(size, 0), _iota(size, 1)
    same_block_CC = rows_CC // SUB == cols_CC // SUB
    for c in range(decay_ref.shape[0]):  # each part stored once formed, so that few tiles are alive at once
        rows = pl.ds(c * size, size)
        g_CK = g_ref[rows, :]
        row_CK = jax.lax.broadcasted_iota(jnp.int32, g_CK.shape, 0)
        G_CK = jnp.cumsum(g_CK, axis=0)
        total_1K = jnp.sum(g_CK, axis=0, keepdims=True)
        decay_ref[c] = jnp.exp(total_1K)

        def cumulative_at(row):  # [1, K]: G at a row
            return jnp.sum(jnp.where(row_CK <= row, g_CK, 0.0), axis=0, keepdims=True)

        def by_block(per_block):  # [C, K]: per_block(j) [1, K] on the rows of 16-row block j
            values = [per_block(j) for j in range(size // SUB)]
            return values[0] if len(values) == 1 else jnp.where(row_CK < SUB, values[0], values[1])

        # each 16-row block's decay products against its own row 7 (factors within e^{+-40}): two exponentials a
        # token-channel; e^G and e^{G_last - G} as them times a per-block factor
        references = [cumulative_at(SUB * j + SUB // 2 - 1) for j in range(size // SUB)]
        reference_CK = by_block(lambda j: references[j])
        left_CK, inverse_left_CK = jnp.exp(G_CK - reference_CK), jnp.exp(reference_CK - G_CK)
        k_CK = k_ref[rows, :].astype(jnp.float32)
        k_CK = k_CK * inverse_norms([k_CK], l2norm)
        right_CK = k_CK * inverse_left_CK
        kg_ref[rows, :] = (by_block(lambda j: jnp.exp(total_1K - references[j])) * right_CK).astype(kg_ref.dtype)
        q_CK = q_ref[rows, :].astype(jnp.float32)
        q_CK = q_CK * (inverse_norms([q_CK], l2norm) * scale)
        a_kk_CC, a_qk_CC = dots.nt(k_CK * left_CK, right_CK), dots.nt(q_CK * left_CK, right_CK)
        if size > SUB:  # the second block's rows against the first's columns: both factors decays, against row 15
            boundary_1K = cumulative_at(SUB - 1)
            # e^{G - G_15} and e^{G_15 - G} as the blocks' factors times a per-block one (no more exponentials)
            cross_left_CK = left_CK * by_block(lambda j: jnp.exp(references[j] - boundary_1K))
            cross_right_CK = right_CK * by_block(lambda j: jnp.exp(boundary_1K - references[j]))
            a_kk_CC = jnp.where(same_block_CC, a_kk_CC, dots.nt(k_CK * cross_left_CK, cross_right_CK))
            a_qk_CC = jnp.where(same_block_CC, a_qk_CC, dots.nt(q_CK * cross_left_CK, cross_right_CK))
        decay_CK = left_CK * by_block(lambda j: jnp.exp(references[j]))
        beta_C1 = beta_ref[rows, :]
        decayed_keys_CK = beta_C1 * decay_CK * k_CK
        a_qk_CC = jnp.where(cols_CC <= rows_CC, a_qk_CC, 0.0)
        a_ref[rows, :] = a_qk_CC.astype(a_ref.dtype)
        qg_ref[rows, :] = (decay_CK * q_CK).astype(qg_ref.dtype)
        inverse_CC = neumann_inverse(jnp.where(cols_CC < rows_CC, beta_C1 * a_kk_CC, 0.0))
        w_ref[rows, :] = dots.nn(inverse_CC, decayed_keys_CK).astype(w_ref.dtype)
        u_ref[rows, :] = dots.nn(inverse_CC, beta_C1 * v_ref[rows, :].astype(jnp.float32)).astype(u_ref.dtype)


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
) -> ChunkParts:
    """Phase 1 over C-token chunks (module docstring; C = tiles.chunk), `intra.intra_chunk`'s signature: q, k
    [B, Tp, H, K], v [B, Tp, H, V], g [B, Tp, H, K] fp32 log-decays >= -5, beta [B, Tp, H, 1] fp32, Tp a multiple
    of C; parts in parts_dtype (default v's), a_qk [BH, Tp, C], decay_last [BH, Tp / C, 1, K]. Grid (B*H, Tp /
    (C x chunks)), chunks the largest power of two <= tiles.chunks dividing Tp / C. Tiles: None from
    `tuned.CHUNK_SHORT`."""
    tiles = tiles or lookup(tuned.CHUNK_SHORT, dtype=v.dtype)
    dtype = v.dtype if parts_dtype is None else parts_dtype
    batch, padded, heads, key_dim = q.shape
    size = tiles.chunk
    if size not in CHUNK_SIZES:
        raise ValueError(f"short_chunk_parts: chunks of {size} tokens, expected one of {CHUNK_SIZES}")
    if padded % size:
        raise ValueError(f"short_chunk_parts: {padded} tokens, expected a multiple of {size}")
    chunks = tiles.chunks
    while (padded // size) % chunks:
        chunks //= 2
    value_dim, flat, span = v.shape[-1], batch * heads, size * chunks
    rows = lambda width: pl.BlockSpec((None, span, None, width), lambda bh, n: (bh // heads, n, bh % heads, 0))  # noqa: E731
    out_rows = lambda width: pl.BlockSpec((None, span, width), lambda bh, n: (bh, n, 0))  # noqa: E731
    parts = pl.pallas_call(
        functools.partial(_kernel, scale=scale, l2norm=use_qk_l2norm, input_dtype=v.dtype),
        grid=(flat, padded // span),
        in_specs=[rows(key_dim), rows(key_dim), rows(value_dim), rows(key_dim), rows(1)],
        out_specs=[
            out_rows(key_dim),
            out_rows(value_dim),
            out_rows(key_dim),
            out_rows(key_dim),
            out_rows(size),
            pl.BlockSpec((None, chunks, 1, key_dim), lambda bh, n: (bh, n, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((flat, padded, key_dim), dtype),
            jax.ShapeDtypeStruct((flat, padded, value_dim), dtype),
            jax.ShapeDtypeStruct((flat, padded, key_dim), dtype),
            jax.ShapeDtypeStruct((flat, padded, key_dim), dtype),
            jax.ShapeDtypeStruct((flat, padded, size), dtype),
            jax.ShapeDtypeStruct((flat, padded // size, 1, key_dim), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret,
        name="kda_prefill_short_chunks",
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
