"""KDA prefill on GPU, phase 1, kernel 1 of 4: the decay-weighted q-k and k-k products of a chunk, by rows of
16x16 blocks (Pallas, Triton lowering). Grid (4, B*H, T/64): program (i, bh, n) owns sub-block i (16 rows) of
chunk n, so every program is short; the sub-block is the fastest-varying grid axis (Triton's x), so a chunk's
4 programs run side by side and its keys and gates, which each reads up to its own rows, come from L2.

With Γ_j the cumulative log-decay inside sub-block j (<= 0, log2 units for exp2) and t_j its total, for row c
of sub-block i and row s of sub-block j <= i the chunk-local decay is
  e^{G_c - G_s} = e^{Γ_c} e^{(t_j - Γ_s) + gap_j},   gap_j = t_{j+1} + ... + t_{i-1} (j < i),
  e^{G_c - G_s} = e^{Γ_c} e^{-Γ_s}                   (j = i, the diagonal block),
so each factor is e^{<= 0} except e^{-Γ_s} <= e^80 for gates >= -5 over 16 steps: fp32 cannot overflow.
The program walks j = i-1 down to 0 (loading k_j, g_j), carrying gap_j, and stores
  qg rows of sub-block i: q_c e^{G_c} = q_c e^{Γ_c} e^{o_i}, o_i = t_0 + ... + t_{i-1} (parts dtype);
  a_qk rows of sub-block i: q_c k_s e^{G_c - G_s} for s <= c, zeros right of the diagonal (parts dtype);
  blocks rows of sub-block i (fp32): L_ij = diag(beta_i) (k_i k_j decay products) for j < i, and on the
  diagonal D_i = (I + L_ii)^-1, inverted in registers (`chunk_gpu_tril.unit_lower_inverse_16`) from L_ii^T,
  formed directly by one more 16x16 product (no transpose). Right of the diagonal: not written;
  key_scale rows of sub-block i: the keys' inverse l2 norms (fp32), for the factor kernels' column blocks.
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


def inverse_norms(x_RK):
    """[rows, 1] fp32: 1 / |x| along K (l2, with the reference's epsilon)."""
    x_RK = x_RK.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.sum(x_RK * x_RK, axis=1, keepdims=True) + L2_EPS)


def normalised(x_RK, l2norm: bool):
    """x [rows, K] as fp32, l2-normalised along K if asked."""
    return x_RK.astype(jnp.float32) * inverse_norms(x_RK) if l2norm else x_RK.astype(jnp.float32)


def _as_row(column_SUB1):
    """A [SUB, 1] column as a [1, SUB] row, through a diagonal mask and a sum (no layout conversion)."""
    return jnp.sum(jnp.where(iota_16(0) == iota_16(1), column_SUB1, 0.0), axis=0, keepdims=True)


def _kernel(q_ref, k_ref, g_ref, beta_ref, qg_ref, a_ref, blocks_ref, key_scale_ref, *, scale, l2norm,
            input_dtype):
    dots = gpu_dots(input_dtype)
    i = pl.program_id(0)
    rows, cols = iota_16(0), iota_16(1)
    log_decay = jnp.cumsum(g_ref[sub_rows(i), :] * LOG2_E, axis=0)  # Γ_i [SUB, K]
    from_start = jnp.exp2(log_decay)  # e^{Γ_c} <= 1
    q_left = normalised(q_ref[...], l2norm) * scale * from_start
    raw_keys = k_ref[sub_rows(i), :]
    key_scale_SUB1 = inverse_norms(raw_keys) if l2norm else jnp.ones((SUB, 1), jnp.float32)
    key_scale_ref[...] = key_scale_SUB1
    k_i = raw_keys.astype(jnp.float32) * key_scale_SUB1
    k_left = k_i * from_start
    beta_SUB1 = beta_ref[...]

    def earlier_block(m, gap_1K):  # sub-block j = i - 1 - m, gap_1K = t_{j+1} + ... + t_{i-1}
        j = i - 1 - m
        g_j = g_ref[sub_rows(j), :] * LOG2_E
        total_1K = jnp.sum(g_j, axis=0, keepdims=True)
        right = normalised(k_ref[sub_rows(j), :], l2norm) * jnp.exp2(total_1K - jnp.cumsum(g_j, axis=0) + gap_1K)
        a_ref[:, sub_rows(j)] = dots.nt(q_left, right).astype(a_ref.dtype)
        blocks_ref[:, sub_rows(j)] = beta_SUB1 * dots.nt(k_left, right)
        return gap_1K + total_1K

    offset_1K = jax.lax.fori_loop(0, i, earlier_block, jnp.zeros((1, k_ref.shape[1]), jnp.float32))  # o_i
    qg_ref[...] = (q_left * jnp.exp2(offset_1K)).astype(qg_ref.dtype)
    right = k_i * jnp.exp2(-log_decay)  # e^{-Γ_s} <= e^80
    a_ref[:, sub_rows(i)] = jnp.where(rows >= cols, dots.nt(q_left, right), 0.0).astype(a_ref.dtype)
    strict_U = jnp.where(rows < cols, dots.nt(right, k_left), 0.0) * _as_row(beta_SUB1)  # L_ii^T
    blocks_ref[:, sub_rows(i)] = unit_lower_inverse_16(strict_U)

    def zero_block(j, carry):
        a_ref[:, sub_rows(j)] = jnp.zeros((SUB, SUB), a_ref.dtype)
        return carry

    jax.lax.fori_loop(i + 1, SUBS, zero_block, 0)


def decay_blocks(q, k, g, beta, *, scale: float, use_qk_l2norm: bool, parts_dtype, num_warps: int = 4,
                 num_stages: int = 1, interpret: bool = False):
    """(qg [BH, Tp, K], a_qk [BH, Tp, CHUNK] in parts_dtype, blocks [BH, Tp, CHUNK] fp32, key_scale [BH, Tp, 1]
    fp32: the keys' inverse l2 norms, or ones without use_qk_l2norm) from q, k [B, Tp, H, K], g [B, Tp, H, K]
    fp32, beta [B, Tp, H, 1] fp32 (Tp a multiple of CHUNK). Grid (CHUNK / SUB, B*H, Tp / CHUNK)."""
    batch, padded, heads, key_dim = q.shape
    flat = batch * heads
    own_rows = lambda width: pl.BlockSpec(  # noqa: E731
        (None, SUB, None, width), lambda i, bh, n: (bh // heads, n * SUBS + i, bh % heads, 0))
    whole_chunk = pl.BlockSpec((None, CHUNK, None, key_dim), lambda i, bh, n: (bh // heads, n, bh % heads, 0))
    out_rows = lambda width: pl.BlockSpec((None, SUB, width), lambda i, bh, n: (bh, n * SUBS + i, 0))  # noqa: E731
    return pl.pallas_call(
        functools.partial(_kernel, scale=scale, l2norm=use_qk_l2norm, input_dtype=q.dtype),
        grid=(SUBS, flat, padded // CHUNK),  # axis 0 varies fastest: a chunk's programs run together
        in_specs=[own_rows(key_dim), whole_chunk, whole_chunk, own_rows(1)],
        out_specs=[out_rows(key_dim), out_rows(CHUNK), out_rows(CHUNK), out_rows(1)],
        out_shape=[jax.ShapeDtypeStruct((flat, padded, key_dim), parts_dtype),
                   jax.ShapeDtypeStruct((flat, padded, CHUNK), parts_dtype),
                   jax.ShapeDtypeStruct((flat, padded, CHUNK), jnp.float32),
                   jax.ShapeDtypeStruct((flat, padded, 1), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_prefill_intra_blocks",
    )(q, k, g, beta)
