"""KDA prefill on GPU, phase 1 of 2: everything inside a 64-token chunk, a Pallas kernel (Triton lowering).

Program (sequence-head, chunk) reads its chunk of q, k, v, g, beta straight from the [B, T, H, ...] inputs and
works through its four 16-row sub-blocks one at a time, storing each output sub-block as soon as it is final.
Only 16x16 blocks (of the decay-weighted key products and of their inverse) live from one sub-block to the
next; a sub-block of k, g, v needed again later is reloaded from its input ref (an L1/L2 hit) and its
cumulative decay recomputed, rather than kept in registers (a [16, K] fp32 value is K / 16 registers per
thread at 8 warps: kept for all four sub-blocks, such values spilled to local memory).
With Γ_i the cumulative log-decay inside sub-block i (<= 0; kept in log2 units for exp2) and t_i its total,
the chunk-local decay of a row of sub-block i is G = o_i + Γ_i, o_i = t_0 + ... + t_{i-1}. Every exponential
is of a gap that is <= 0, except inside a diagonal sub-block, where it is bounded by e^80 for gates >= -5
(16 steps). For row c of sub-block i and row s of sub-block j <= i:
  e^{G_c - G_s} = e^{Γ_c} e^{o_i - G_s},  e^{o_i - G_s} = e^{t_{j+1} + ... + t_{i-1}} e^{t_j - Γ_s} (j < i)
  or e^{-Γ_s} (j = i).
The program writes (in parts_dtype, v's by default, unless said otherwise; T = (I + L)^-1 diag(beta), L = strictly lower
diag(beta) A_kk, inverted as 16x16 blocks: the four diagonal ones by forward substitution, side by side,
then the blocks below them):
  w = T (e^G k), u = T v, qg = e^G q (normalised, scaled), kg = e^{G_last - G} k, a_qk [64, 64] (q-k decay
  products, lower incl. diagonal) and decay_last = e^{G_last} (fp32).
in two passes: (1) per sub-block i, its rows of a_qk, qg, kg and of L; (2) after the inverse, per sub-block i,
its rows of w and u. Products run on tensor cores: tf32 for bf16/fp16 inputs (whose own rounding is larger),
IEEE fp32 for fp32. No product has two operands that are inputs as given (each carries a decay, beta or the
inverse), so none runs on bf16 operands without rounding an fp32 factor to bf16.
"""

from __future__ import annotations

import functools
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda.chunk_math import SUB, Dots, unit_lower_inverses
from pallas_kernels.kda.reference import L2_EPS

CHUNK = 64
SUBS = CHUNK // SUB  # sub-blocks per chunk
LOG2_E = 1.4426950408889634


class ChunkParts(NamedTuple):
    """Phase 1's output, per sequence-head (BH = B*H, Tp = T padded to whole chunks, N = Tp / CHUNK)."""

    w: jax.Array  # [BH, Tp, K] T (e^G k)
    u: jax.Array  # [BH, Tp, V] T v
    qg: jax.Array  # [BH, Tp, K] e^G q
    kg: jax.Array  # [BH, Tp, K] e^{G_last - G} k
    a_qk: jax.Array  # [BH, Tp, CHUNK] sum_i q_c k_s e^{G_c - G_s} for s <= c, else 0
    decay_last: jax.Array  # [BH, N, 1, K] fp32 e^{G_last}


def gpu_dots(input_dtype) -> Dots:
    """Tensor-core products for a kernel whose inputs came as `input_dtype`: fp32 operands in tf32 when that is
    bf16/fp16 (whose own rounding is larger), IEEE fp32 for fp32 inputs; 16-bit operands at their own precision."""
    allow_tf32 = input_dtype != jnp.float32
    return Dots(nn=functools.partial(plgpu.dot, allow_tf32=allow_tf32),
                nt=functools.partial(plgpu.dot, trans_b=True, allow_tf32=allow_tf32),
                tn=functools.partial(plgpu.dot, trans_a=True, allow_tf32=allow_tf32))


def _iota(axis: int):
    return jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), axis)


def _rows(i: int):
    return pl.ds(i * SUB, SUB)


def _inverse_norms_SUB1(x_SUBK):
    return jax.lax.rsqrt(jnp.sum(x_SUBK * x_SUBK, axis=1, keepdims=True) + L2_EPS)


def _store(ref, i: int, x):
    ref[_rows(i), :] = x.astype(ref.dtype)


def _store_row_of_blocks(ref, i: int, blocks):
    """Sub-block i's rows of a [CHUNK, CHUNK] matrix from its 16x16 blocks up to the diagonal; zeros after it."""
    for j in range(SUBS):
        block = blocks[j] if j < len(blocks) else jnp.zeros((SUB, SUB), jnp.float32)
        ref[_rows(i), pl.ds(j * SUB, SUB)] = block.astype(ref.dtype)


def _sum(terms):
    return functools.reduce(operator.add, terms)


class _SubBlocks:
    """The chunk's keys and gates by sub-block, loaded (again) on demand. Kept across sub-blocks: only the
    per-row inverse key norms ([SUB, 1] each) and the per-sub-block gate totals t_i ([1, K] each, log2 units)."""

    def __init__(self, k_ref, g_ref, l2norm: bool):
        self.k_ref, self.g_ref = k_ref, g_ref
        self.key_norms = [_inverse_norms_SUB1(self._raw_keys(i)) if l2norm else None for i in range(SUBS)]
        self.totals = [jnp.sum(g_ref[_rows(i), :], axis=0, keepdims=True) * LOG2_E for i in range(SUBS)]

    def _raw_keys(self, i: int):
        return self.k_ref[_rows(i), :].astype(jnp.float32)

    def keys(self, i: int):
        """k_i [SUB, K] fp32, l2-normalised if asked."""
        norms = self.key_norms[i]
        return self._raw_keys(i) if norms is None else self._raw_keys(i) * norms

    def log_decay(self, i: int):
        """Γ_i [SUB, K]: cumulative log2-decay inside sub-block i, <= 0."""
        return jnp.cumsum(self.g_ref[_rows(i), :] * LOG2_E, axis=0)

    def gap(self, start: int, stop: int):
        """log2-decay from the start of sub-block `start` to the start of sub-block `stop` ([1, K], 0 if empty)."""
        return sum(self.totals[start:stop], jnp.zeros_like(self.totals[0]))

    def keys_to_end(self, i: int, k_SUBK, log_decay_SUBK):
        """k_s e^{t_i - Γ_s} <= k_s: sub-block i's keys decayed to its end."""
        return k_SUBK * jnp.exp2(self.totals[i] - log_decay_SUBK)

    def keys_to_start_of(self, stop: int, j: int):
        """k_s e^{o_stop - G_s} <= k_s for sub-block j < stop, reloaded."""
        return self.keys_to_end(j, self.keys(j), self.log_decay(j)) * jnp.exp2(self.gap(j + 1, stop))


def _decay_rows(blocks: _SubBlocks, i: int, q_ref, beta_ref, qg_ref, kg_ref, a_ref, *, scale, l2norm, dots):
    """Pass 1 for sub-block i: stores its rows of qg, kg and a_qk; returns its 16x16 blocks of L up to the
    diagonal. Live [SUB, K] values: q and k decayed from the sub-block's start, and k and Γ_i until the
    diagonal blocks are formed, then one reloaded sub-block at a time."""
    q = q_ref[_rows(i), :].astype(jnp.float32)
    q = (q * _inverse_norms_SUB1(q) if l2norm else q) * scale
    k, local = blocks.keys(i), blocks.log_decay(i)
    beta = beta_ref[_rows(i), :]  # [SUB, 1]
    from_start = jnp.exp2(local)  # e^{G_c - o_i} <= 1
    q_left, k_left = q * from_start, k * from_start
    _store(qg_ref, i, q_left * jnp.exp2(blocks.gap(0, i)))
    _store(kg_ref, i, blocks.keys_to_end(i, k, local) * jnp.exp2(blocks.gap(i + 1, SUBS)))

    def products(right_SUBK):  # (a_qk block, L block)
        return dots.nt(q_left, right_SUBK), beta * dots.nt(k_left, right_SUBK)

    a_qk_diagonal, L_diagonal = products(k * jnp.exp2(-local))  # first, so k and Γ_i die here; <= e^80
    below = [products(blocks.keys_to_start_of(i, j)) for j in range(i)]
    _store_row_of_blocks(a_ref, i, [a for a, _ in below] + [jnp.where(_iota(0) >= _iota(1), a_qk_diagonal, 0.0)])
    return [L for _, L in below] + [jnp.where(_iota(0) > _iota(1), L_diagonal, 0.0)]


def _block_inverse(strict_L, dots: Dots):
    """(I + L)^-1 as 16x16 blocks X[i][j], j <= i, for the strictly lower [CHUNK, CHUNK] L given as blocks
    L[i][j]: the diagonal blocks' inverses D_i (in lockstep), then X_ij = -D_i sum_{m=j}^{i-1} L_im X_mj."""
    diagonal = unit_lower_inverses([strict_L[i][i] for i in range(SUBS)], dots)
    inverse = []
    for i in range(SUBS):
        inverse.append([-dots.nn(diagonal[i], _sum(dots.nn(strict_L[i][m], inverse[m][j]) for m in range(j, i)))
                        for j in range(i)] + [diagonal[i]])
    return inverse


def _wy_rows(blocks: _SubBlocks, i: int, inverse_row, v_ref, beta_ref, w_ref, u_ref, dots):
    """Pass 2 for sub-block i: w_i = sum_j X_ij (beta_j e^{G_j} k_j), u_i = sum_j X_ij (beta_j v_j), j <= i,
    sub-block j's keys, gates and values reloaded. Live [SUB, K] values: the two sums and one reloaded block."""
    w = u = 0.0
    for j in range(i + 1):
        beta = beta_ref[_rows(j), :]
        decay = jnp.exp2(blocks.gap(0, j)) * jnp.exp2(blocks.log_decay(j))  # e^{G} <= 1
        w = w + dots.nn(inverse_row[j], beta * blocks.keys(j) * decay)
        u = u + dots.nn(inverse_row[j], beta * v_ref[_rows(j), :].astype(jnp.float32))
    _store(w_ref, i, w)
    _store(u_ref, i, u)


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, qg_ref, kg_ref, a_ref, decay_ref,
            *, scale, use_qk_l2norm):
    dots = gpu_dots(v_ref.dtype)
    blocks = _SubBlocks(k_ref, g_ref, use_qk_l2norm)
    decay_ref[...] = jnp.exp2(blocks.gap(0, SUBS))
    strict_L = [_decay_rows(blocks, i, q_ref, beta_ref, qg_ref, kg_ref, a_ref, scale=scale,
                            l2norm=use_qk_l2norm, dots=dots) for i in range(SUBS)]
    inverse = _block_inverse(strict_L, dots)  # T = (I + L)^-1 diag(beta)
    for i in range(SUBS):
        _wy_rows(blocks, i, inverse[i], v_ref, beta_ref, w_ref, u_ref, dots)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "parts_dtype", "num_warps", "num_stages",
                                             "interpret"))
def intra_chunk(q, k, v, g, beta, *, scale: float, use_qk_l2norm: bool = True, parts_dtype=None,
                num_warps: int = 8, num_stages: int = 1, interpret: bool = False) -> ChunkParts:
    """Phase 1 over whole chunks: q, k [B, Tp, H, K], v [B, Tp, H, V], g [B, Tp, H, K] fp32 log-decay,
    beta [B, Tp, H, 1] fp32, Tp a multiple of CHUNK; parts stored as parts_dtype (default v's).
    Grid (B*H, Tp / CHUNK), all programs independent; num_warps, num_stages are Triton's."""
    batch, padded, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    flat, num_chunks = batch * heads, padded // CHUNK
    dtype = v.dtype if parts_dtype is None else parts_dtype
    source = lambda width: pl.BlockSpec(  # noqa: E731
        (None, CHUNK, None, width), lambda bh, n: (bh // heads, n, bh % heads, 0))
    target = lambda width: pl.BlockSpec((None, CHUNK, width), lambda bh, n: (bh, n, 0))  # noqa: E731
    per_token = lambda width, dt: jax.ShapeDtypeStruct((flat, padded, width), dt)  # noqa: E731
    return ChunkParts(*pl.pallas_call(
        functools.partial(_kernel, scale=scale, use_qk_l2norm=use_qk_l2norm),
        grid=(flat, num_chunks),
        in_specs=[source(key_dim), source(key_dim), source(value_dim), source(key_dim), source(1)],
        out_specs=[target(key_dim), target(value_dim), target(key_dim), target(key_dim), target(CHUNK),
                   pl.BlockSpec((None, None, 1, key_dim), lambda bh, n: (bh, n, 0, 0))],
        out_shape=[per_token(key_dim, dtype), per_token(value_dim, dtype), per_token(key_dim, dtype),
                   per_token(key_dim, dtype), per_token(CHUNK, dtype),
                   jax.ShapeDtypeStruct((flat, num_chunks, 1, key_dim), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_prefill_intra_chunk",
    )(q, k, v, g, beta))
