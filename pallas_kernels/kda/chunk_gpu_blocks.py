"""KDA prefill on GPU, phase 1, kernel 1 of 2: a chunk's decay-weighted q-k and k-k products as 16-column
blocks, the diagonal blocks' inverses and the decayed q and k (Pallas, Triton lowering). Grid (B*H, T/64): one
program per chunk, straight-line code over whole-chunk tiles, its 16-row sub-blocks held as the leading axis of
[4, 16, block_k] tiles (so the sub-block sums and scans are reductions along an axis, with no loop over
sub-blocks and no trip count that depends on the program id: the earlier kernel, one program per sub-block
looping over the others, spent half its 6 ms on those loops on an H200, BENCHMARKS.md).

In log2 units, with Γ_c the cumulative gate of row c inside its sub-block b (0 >= Γ >= -115 for gates >= -5),
t_b the sub-block's total and the chunk-local G_c = o_b + Γ_c (o_b = t_0 + ... + t_{b-1}), the decay between
row c of sub-block b and row s of sub-block j < b is
  2^{G_c - G_s} = [2^{Γ_c} 2^{t_{j+1} + ... + t_{b-1}}] [2^{t_j - Γ_s}],
both brackets <= 1 (where one underflows, the product is below 2^-115 anyway); on the diagonal block (j = b)
  2^{G_c - G_s} = [2^{Γ_c} 2^S] [2^{-Γ_s} 2^{-S}],
with the fixed shift 2^S = 2^58, both in [2^-58, 2^58]: fp32 can neither overflow nor lose a factor to
underflow (2^{Γ_c} alone, down to 2^-115, times a small key component went subnormal: 4e-4 off at K = 64), and
the same Γ in both makes the diagonal exact. The shift multiplies an exp2 by a power of two (exact), rather than
entering its argument (which would round a slow decay's small exponent to the ulp of ~58). Every exponent is a
within-sub-block scan plus a sum of a few sub-block totals, never the difference of two sums over the whole
chunk (whose fp32 rounding, ~|G| ulp, put 1e-4 errors into kg). Sub-block j's 16 rows are reloaded (from L1)
for the right bracket and the diagonal block's factors; the left bracket is one product over the whole chunk
per column block j.

Stored per chunk (block rows of 16 x 16):
  qg = q e^G, kb = beta e^G k, kg = e^{G_last - G} k (parts dtype), decay_last = e^{G_last} (fp32);
  a_qk: q_c k_s e^{G_c - G_s} for s <= c, zeros above the diagonal (parts dtype);
  blocks (fp32): below the diagonal L_bj = diag(beta_b) (k_b k_j decay products), on it D_j = (I + L_jj)^-1
  (`chunk_gpu_tril.unit_lower_inverse_16`, from L_jj^T formed by one more 16x16 product), zeros above.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda.chunk_gpu_tril import CHUNK, SUB, SUBS, gpu_dots, iota_16, sub_rows, unit_lower_inverse_16
from pallas_kernels.kda.reference import L2_EPS

LOG2_E = 1.4426950408889634
SHIFT_UP, SHIFT_DOWN = 2.0 ** 58, 2.0 ** -58  # half the widest decay across a sub-block (16 gates >= -5: 2^-115)


def _inverse_norms(ref, rows, size, column_blocks, l2norm: bool):
    """1 / |x| (l2, with the reference's epsilon) of ref's `size` rows `rows`, as a column [size, 1]; ones
    without l2norm."""
    if not l2norm:
        return jnp.ones((size, 1), jnp.float32)
    squares = [jnp.sum(jnp.square(ref[rows, columns].astype(jnp.float32)), axis=1, keepdims=True)
               for columns in column_blocks]
    return jax.lax.rsqrt(functools.reduce(jnp.add, squares) + L2_EPS)


def _by_sub_block(x, width):
    """[CHUNK, width] -> [SUBS, SUB, width]: sub-block b's rows as x[b]."""
    return x.reshape(SUBS, SUB, width)


def _per_sub_block(matrix_bbB, mask_bb):
    """sum over b' of matrix[b, b'] where mask[b, b'] ([SUBS, SUBS] bools): [SUBS, block_k] from [SUBS, SUBS, bk]."""
    return jnp.sum(jnp.where(mask_bb[:, :, None], matrix_bbB, 0.0), axis=1)


def _as_row(column_SUB1):
    """A [SUB, 1] column as a [1, SUB] row, through a diagonal mask and a sum (no layout conversion)."""
    return jnp.sum(jnp.where(iota_16(0) == iota_16(1), column_SUB1, 0.0), axis=0, keepdims=True)


def _sub_block_factors(q_ref, k_ref, g_ref, j, columns, query_scale_SUB1, key_scale_SUB1):
    """Sub-block j's rows, columns `columns`, reloaded: (k_s 2^{t_j - Γ_s}, the right factor of the blocks below
    the diagonal; q_c 2^{Γ_c + S}, k_c 2^{Γ_c + S}, k_s 2^{-Γ_s - S}, the diagonal block's factors)."""
    g_SUBB = g_ref[sub_rows(j), columns] * LOG2_E
    scan = jnp.cumsum(g_SUBB, axis=0)  # Γ
    keys = k_ref[sub_rows(j), columns].astype(jnp.float32) * key_scale_SUB1
    up = jnp.exp2(scan) * SHIFT_UP
    return (keys * jnp.exp2(jnp.sum(g_SUBB, axis=0, keepdims=True) - scan),
            q_ref[sub_rows(j), columns].astype(jnp.float32) * query_scale_SUB1 * up, keys * up,
            keys * (jnp.exp2(-scan) * SHIFT_DOWN))


def _kernel(q_ref, k_ref, g_ref, beta_ref, qg_ref, a_ref, blocks_ref, kb_ref, kg_ref, decay_ref, *, scale, l2norm,
            input_dtype, block_k):
    """One chunk; keys worked through block_k columns at a time, the products summed over them."""
    dots = gpu_dots(input_dtype)
    key_dim = k_ref.shape[1]
    column_blocks = [pl.ds(c * block_k, block_k) for c in range(key_dim // block_k)]
    everything = slice(None)
    query_scale_CHUNK1 = _inverse_norms(q_ref, everything, CHUNK, column_blocks, l2norm) * scale
    key_scale_CHUNK1 = _inverse_norms(k_ref, everything, CHUNK, column_blocks, l2norm)
    query_scale, key_scale = _by_sub_block(query_scale_CHUNK1, 1), _by_sub_block(key_scale_CHUNK1, 1)
    query_scales = [_inverse_norms(q_ref, sub_rows(j), SUB, column_blocks, l2norm) * scale for j in range(SUBS)]
    key_scales = [_inverse_norms(k_ref, sub_rows(j), SUB, column_blocks, l2norm) for j in range(SUBS)]
    beta = _by_sub_block(beta_ref[...], 1)
    sub_block = jax.lax.broadcasted_iota(jnp.int32, (SUBS, SUBS), 0)  # [b, b']
    other = jax.lax.broadcasted_iota(jnp.int32, (SUBS, SUBS), 1)
    sub_block_column = jax.lax.broadcasted_iota(jnp.int32, (SUBS, 1), 0)
    zeros = lambda rows: [jnp.zeros((rows, SUB), jnp.float32) for _ in range(SUBS)]  # noqa: E731
    a_qk, a_kk = zeros(CHUNK), zeros(CHUNK)  # column block j of each product, below the diagonal block
    a_qk_diagonal, a_kk_diagonal_T = zeros(SUB), zeros(SUB)
    for columns in column_blocks:
        g = _by_sub_block(g_ref[:, columns] * LOG2_E, block_k)
        scan = jnp.cumsum(g, axis=1)  # Γ
        totals = jnp.sum(g, axis=1)  # [SUBS, block_k]: t_b
        each = jnp.broadcast_to(totals[None], (SUBS, SUBS, block_k))  # [b, b'] -> t_b'
        before, after = _per_sub_block(each, other < sub_block), _per_sub_block(each, other > sub_block)  # o_b, ...
        decay_in = jnp.exp2(scan)  # 2^Γ in [2^-115, 1]
        queries = q_ref[:, columns].astype(jnp.float32).reshape(SUBS, SUB, block_k) * query_scale
        keys = k_ref[:, columns].astype(jnp.float32).reshape(SUBS, SUB, block_k) * key_scale
        decay = decay_in * jnp.exp2(before)[:, None, :]  # e^G
        qg_ref[:, columns] = (queries * decay).reshape(CHUNK, block_k).astype(qg_ref.dtype)
        kb_ref[:, columns] = (beta * keys * decay).reshape(CHUNK, block_k).astype(kb_ref.dtype)
        to_last = (totals[:, None, :] - scan) + after[:, None, :]  # G_last - G_c, from local sums
        kg_ref[:, columns] = (keys * jnp.exp2(to_last)).reshape(CHUNK, block_k).astype(kg_ref.dtype)
        decay_ref[:, columns] = jnp.exp2(jnp.sum(totals, axis=0, keepdims=True))
        for j in range(SUBS):
            right, q_up, k_up, k_down = _sub_block_factors(q_ref, k_ref, g_ref, j, columns, query_scales[j],
                                                           key_scales[j])
            a_qk_diagonal[j] = a_qk_diagonal[j] + dots.nt(q_up, k_down)
            a_kk_diagonal_T[j] = a_kk_diagonal_T[j] + dots.nt(k_down, k_up)
            if j == SUBS - 1:
                continue  # no sub-block below the last
            between = _per_sub_block(each, (other > j) & (other < sub_block))  # t_{j+1} + ... + t_{b-1}
            left = decay_in * jnp.where(sub_block_column > j, jnp.exp2(between), 0.0)[:, None, :]
            a_qk[j] = a_qk[j] + dots.nt((queries * left).reshape(CHUNK, block_k), right)
            a_kk[j] = a_kk[j] + dots.nt((keys * left).reshape(CHUNK, block_k), right)
    row_block = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, SUB), 0) // SUB
    row = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, SUB), 0) % SUB
    column = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, SUB), 1)
    tiled = lambda x_SUBSUB: jnp.broadcast_to(x_SUBSUB[None], (SUBS, SUB, SUB)).reshape(CHUNK, SUB)  # noqa: E731
    beta_CHUNK1 = beta_ref[...]
    for j in range(SUBS):
        on_diagonal = (row_block == j) & (row >= column)
        a_ref[:, sub_rows(j)] = jnp.where(row_block > j, a_qk[j], jnp.where(on_diagonal, tiled(a_qk_diagonal[j]),
                                                                            0.0)).astype(a_ref.dtype)
        strict_U = jnp.where(iota_16(0) < iota_16(1), a_kk_diagonal_T[j], 0.0) * _as_row(beta_ref[sub_rows(j), :])
        blocks_ref[:, sub_rows(j)] = jnp.where(row_block > j, beta_CHUNK1 * a_kk[j], jnp.where(
            row_block == j, tiled(unit_lower_inverse_16(strict_U)), 0.0))


def decay_blocks(q, k, g, beta, *, scale: float, use_qk_l2norm: bool, parts_dtype, block_k: int = 64,
                 num_warps: int = 4, num_stages: int = 1, interpret: bool = False):
    """(qg [BH, Tp, K], a_qk [BH, Tp, CHUNK] in parts_dtype, blocks [BH, Tp, CHUNK] fp32, kb, kg [BH, Tp, K] in
    parts_dtype, decay_last [BH, N, 1, K] fp32) from q, k [B, Tp, H, K], g [B, Tp, H, K] fp32, beta [B, Tp, H, 1]
    fp32 (Tp = N * CHUNK). Grid (B*H, N); the keys are worked through block_k columns at a time (a power of
    two, at least 16)."""
    batch, padded, heads, key_dim = q.shape
    flat, num_chunks = batch * heads, padded // CHUNK
    chunk = lambda width: pl.BlockSpec(  # noqa: E731
        (None, CHUNK, None, width), lambda bh, n: (bh // heads, n, bh % heads, 0))
    out_rows = lambda width: pl.BlockSpec((None, CHUNK, width), lambda bh, n: (bh, n, 0))  # noqa: E731
    return pl.pallas_call(
        functools.partial(_kernel, scale=scale, l2norm=use_qk_l2norm, input_dtype=q.dtype,
                          block_k=min(block_k, key_dim)),
        grid=(flat, num_chunks),  # axis 0 varies fastest
        in_specs=[chunk(key_dim), chunk(key_dim), chunk(key_dim), chunk(1)],
        out_specs=[out_rows(key_dim), out_rows(CHUNK), out_rows(CHUNK), out_rows(key_dim), out_rows(key_dim),
                   pl.BlockSpec((None, None, 1, key_dim), lambda bh, n: (bh, n, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((flat, padded, key_dim), parts_dtype),
                   jax.ShapeDtypeStruct((flat, padded, CHUNK), parts_dtype),
                   jax.ShapeDtypeStruct((flat, padded, CHUNK), jnp.float32),
                   jax.ShapeDtypeStruct((flat, padded, key_dim), parts_dtype),
                   jax.ShapeDtypeStruct((flat, padded, key_dim), parts_dtype),
                   jax.ShapeDtypeStruct((flat, num_chunks, 1, key_dim), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_prefill_intra_blocks",
    )(q, k, g, beta)
