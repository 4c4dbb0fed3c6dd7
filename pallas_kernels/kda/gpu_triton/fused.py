"""KDA prefill on GPU, phase 1 in two kernels (the variant gpu_triton_fused): the keys and block-row kernels of
`blocks` fused into one kernel that works on whole 64-row chunks, then `tril.wy_factors`.

`chunk_blocks`, grid (B*H, T/64), the sequence-head fastest: program (bh, n) owns chunk n of sequence-head bh and
forms every product of the chunk as [64, 16] column blocks, `tril.CHUNK` rows at a time (products [64, block_k] x
[block_k, 16], whose 64 rows spread over the warps, where `blocks` ran [16, block_k] x [block_k, 16] products
in a program per 16-row sub-block with loops over the earlier sub-blocks, after a kernel storing their decayed
keys). One program per chunk doing the sub-blocks in turn with [16, block_k] tiles, the WY factors included,
measured 2.4-3x slower than the three kernels (docs/benchmarks/kda.md, issue 27): such products keep one warp
busy, so the chain of 16-row steps ran with little to overlap it.

Column block j (16 columns, sub-block j) uses the decay to its own last row as reference: with G the chunk's
cumulative log-decay (log2 units), R_j = G at row 16j + 15 and t_j sub-block j's total,
  e^{G_c - G_s} = 2^{G_c - R_j - S} 2^{(t_j - Γ_s) + S}   (rows c >= 16j; columns s of sub-block j),
Γ_s the cumulative log-decay inside sub-block j. The right factor, sub-block j's keys decayed to its end, comes
from its own 16 rows (loaded again; Γ and t_j are sums of its gates alone); the left one from the chunk's rows,
its exponent forced to -inf above sub-block j (so those rows of the column block are 0, and nothing overflows).
For gates >= -5 both exponents lie in [-115, 0] (16 gates); the shift e^S = 2^58 (a product by a power of two,
exact) keeps each factor within 2^{+-58} on the diagonal block, where fp32 can neither overflow nor lose a factor
to underflow; below it the left factor is <= 2^-58, and where it underflows the decay is below 2^-68 anyway. So
the kernel takes gates >= -5 only (`chunk_math.GATE_FLOOR`; any-gate prefill: `gpu_triton_any_gate`).

It stores what `blocks.decay_blocks` stores, but the diagonal blocks of L = diag(beta) A_kk as they are (its
upper triangle unmasked), left for `tril.wy_factors` (invert_diagonal) to invert: qg = e^G q, a_qk, L by
column blocks, kb = beta e^G k, kg = e^{G_last - G} k (from sub-block j's rows decayed to its end times the later
totals, as `blocks`: no difference of two 64-gate sums in the exponent) and e^{G_last}. e^G and the left factor
are exponentials of G, a 64-row running sum (its fp32 rounding, ~ulp(|G|), enters the exponent: ~1e-5
relative at the gate bound, as in the jnp chunked form).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda import tuned
from pallas_kernels.kda.gpu_triton.blocks import LOG2_E, SHIFT_DOWN, SHIFT_UP, inverse_norms, key_column_blocks
from pallas_kernels.kda.gpu_triton.intra import ChunkParts
from pallas_kernels.kda.gpu_triton.tril import CHUNK, SUB, SUBS, gpu_dots, sub_rows, wy_factors
from pallas_kernels.tuning import fill, lookup


def _tiles(ref, columns_list, rows=slice(None)):
    return [ref[rows, columns].astype(jnp.float32) for columns in columns_list]


def _kernel(
    q_ref,
    k_ref,
    g_ref,
    beta_ref,
    qg_ref,
    a_ref,
    blocks_ref,
    kb_ref,
    kg_ref,
    decay_ref,
    *,
    scale,
    l2norm,
    input_dtype,
    block_k,
):
    """Chunk n's rows of every output (module docstring), block_k key columns at a time."""
    dots = gpu_dots(input_dtype)
    key_blocks = key_column_blocks(k_ref.shape[1], block_k)
    query_scale = inverse_norms(_tiles(q_ref, key_blocks), l2norm) * scale  # [CHUNK, 1]
    key_scale = inverse_norms(_tiles(k_ref, key_blocks), l2norm)
    sub_key_scales = [inverse_norms(_tiles(k_ref, key_blocks, sub_rows(j)), l2norm) for j in range(SUBS)]
    beta = beta_ref[...]  # [CHUNK, 1]
    rows_CB = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, block_k), 0)
    zeros_CS = jnp.zeros((CHUNK, SUB), jnp.float32)
    a_qk, a_kk = [zeros_CS] * SUBS, [zeros_CS] * SUBS
    for columns in key_blocks:
        log_decay = jnp.cumsum(g_ref[:, columns] * LOG2_E, axis=0)  # G
        queries = q_ref[:, columns].astype(jnp.float32) * query_scale
        keys = k_ref[:, columns].astype(jnp.float32) * key_scale
        end, totals, rights = jnp.zeros((1, block_k), jnp.float32), [], []
        for j in range(SUBS):
            gates = g_ref[sub_rows(j), columns] * LOG2_E
            totals.append(jnp.sum(gates, axis=0, keepdims=True))  # t_j
            keys_j = k_ref[sub_rows(j), columns].astype(jnp.float32) * sub_key_scales[j]
            rights.append(keys_j * (jnp.exp2(totals[j] - jnp.cumsum(gates, axis=0)) * SHIFT_UP))
            end = end + totals[j]  # R_j
            left = jnp.exp2(jnp.where(rows_CB >= SUB * j, log_decay - end, -jnp.inf)) * SHIFT_DOWN
            a_qk[j] = a_qk[j] + dots.nt(queries * left, rights[j])
            a_kk[j] = a_kk[j] + dots.nt(keys * left, rights[j])
        decay = jnp.exp2(log_decay)  # e^G (an underflow to 0 is a decay below e^-87)
        qg_ref[:, columns] = (queries * decay).astype(qg_ref.dtype)
        kb_ref[:, columns] = (beta * keys * decay).astype(kb_ref.dtype)
        decay_ref[:, columns] = jnp.exp2(end)  # e^{G_last}
        later = jnp.zeros_like(end)  # t_{j+1} + ... + t_3
        for j in reversed(range(SUBS)):
            kg_ref[sub_rows(j), columns] = (rights[j] * (jnp.exp2(later) * SHIFT_DOWN)).astype(kg_ref.dtype)
            later = later + totals[j]
    rows_CS = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, SUB), 0)
    cols_CS = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, SUB), 1)
    for j in range(SUBS):
        a_ref[:, sub_rows(j)] = jnp.where(rows_CS >= cols_CS + SUB * j, a_qk[j], 0.0).astype(a_ref.dtype)
        blocks_ref[:, sub_rows(j)] = beta * a_kk[j]


def chunk_blocks(
    q,
    k,
    g,
    beta,
    *,
    scale: float,
    use_qk_l2norm: bool,
    parts_dtype,
    block_k: int | None = None,
    num_warps: int | None = None,
    interpret: bool = False,
):
    """(qg [BH, Tp, K], a_qk [BH, Tp, CHUNK] in parts_dtype, blocks [BH, Tp, CHUNK] fp32: L by column blocks,
    its diagonal blocks not inverted and their upper triangles not masked, kb, kg [BH, Tp, K] in parts_dtype,
    decay_last [BH, N, 1, K] fp32) from q, k [B, Tp, H, K], g [B, Tp, H, K] fp32 (>= -5), beta [B, Tp, H, 1]
    fp32, Tp = N * CHUNK. Grid (B*H, N); block_k key columns at a time (a power of two). Tiles: None from
    `tuned.CHUNK_FUSED`."""
    tiles = lookup(tuned.CHUNK_FUSED, dtype=q.dtype)
    block_k, num_warps = fill((block_k, num_warps), (tiles.block_k, tiles.num_warps))
    batch, padded, heads, key_dim = q.shape
    flat, num_chunks = batch * heads, padded // CHUNK
    chunk_rows = lambda width: pl.BlockSpec(  # noqa: E731
        (None, CHUNK, None, width), lambda bh, n: (bh // heads, n, bh % heads, 0)
    )
    out_rows = lambda width: pl.BlockSpec((None, CHUNK, width), lambda bh, n: (bh, n, 0))  # noqa: E731
    out_shape = lambda width, dtype=parts_dtype: jax.ShapeDtypeStruct((flat, padded, width), dtype)  # noqa: E731
    return pl.pallas_call(
        functools.partial(
            _kernel, scale=scale, l2norm=use_qk_l2norm, input_dtype=q.dtype, block_k=min(block_k, key_dim)
        ),
        grid=(flat, num_chunks),  # axis 0 varies fastest
        in_specs=[chunk_rows(key_dim), chunk_rows(key_dim), chunk_rows(key_dim), chunk_rows(1)],
        out_specs=[
            out_rows(key_dim),
            out_rows(CHUNK),
            out_rows(CHUNK),
            out_rows(key_dim),
            out_rows(key_dim),
            pl.BlockSpec((None, None, 1, key_dim), lambda bh, n: (bh, n, 0, 0)),
        ],
        out_shape=[
            out_shape(key_dim),
            out_shape(CHUNK),
            out_shape(CHUNK, jnp.float32),
            out_shape(key_dim),
            out_shape(key_dim),
            jax.ShapeDtypeStruct((flat, num_chunks, 1, key_dim), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_prefill_fused_blocks",
    )(q, k, g, beta)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "use_qk_l2norm", "parts_dtype", "block_k", "num_warps", "factors_num_warps", "interpret"),
)
def fused_intra_chunk(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale: float,
    use_qk_l2norm: bool = True,
    parts_dtype=None,
    block_k: int | None = None,
    num_warps: int | None = None,
    factors_num_warps: int | None = None,
    interpret: bool = False,
) -> ChunkParts:
    """Phase 1 as `chunk_blocks` then `tril.wy_factors` (inverting the diagonal blocks): the same `ChunkParts` as
    `intra.intra_chunk` from the same inputs (q, k [B, Tp, H, K], v [B, Tp, H, V], g [B, Tp, H, K] fp32 >= -5,
    beta [B, Tp, H, 1] fp32, Tp a multiple of CHUNK; parts in parts_dtype, default v's). Tiles: None from
    `tuned.CHUNK_FUSED`."""
    block_k, num_warps, factors_num_warps = fill(
        (block_k, num_warps, factors_num_warps), lookup(tuned.CHUNK_FUSED, dtype=v.dtype)
    )
    dtype = v.dtype if parts_dtype is None else parts_dtype
    qg, a_qk, blocks, kb, kg, decay_last = chunk_blocks(
        q,
        k,
        g,
        beta,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        parts_dtype=dtype,
        block_k=block_k,
        num_warps=num_warps,
        interpret=interpret,
    )
    w, u = wy_factors(
        blocks,
        kb,
        v,
        beta,
        parts_dtype=dtype,
        input_dtype=v.dtype,
        num_warps=factors_num_warps,
        invert_diagonal=True,
        interpret=interpret,
    )
    return ChunkParts(w, u, qg, kg, a_qk, decay_last)
