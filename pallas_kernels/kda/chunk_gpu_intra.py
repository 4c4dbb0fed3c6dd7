"""KDA prefill on GPU, phase 1 of 2: everything inside a 64-token chunk, a Pallas kernel (Triton lowering).

Program (sequence-head, chunk) reads its chunk of q, k, v, g, beta straight from the [B, T, H, ...] inputs and
works on four 16-row sub-blocks kept as Python lists (the Triton lowering neither slices nor concatenates
values). With Γ_i the cumulative log-decay inside sub-block i (<= 0; kept in log2 units for exp2) and t_i
its total, the chunk-local decay of a row of sub-block i is G = o_i + Γ_i, o_i = t_0 + ... + t_{i-1}. Every
exponential is of a gap that is <= 0, except inside a diagonal sub-block, where it is bounded by e^80 for
gates >= -5 (16 steps). For row c of sub-block i and row s of sub-block j <= i:
  e^{G_c - G_s} = e^{Γ_c} e^{o_i - G_s},  e^{o_i - G_s} = e^{t_{j+1} + ... + t_{i-1}} e^{t_j - Γ_s} (j < i)
  or e^{-Γ_s} (j = i).
The program writes (in parts_dtype, v's by default, unless said otherwise; T = (I + L)^-1 diag(beta), L = strictly lower
diag(beta) A_kk, inverted as 16x16 blocks: the four diagonal ones by forward substitution, side by side,
then the blocks below them):
  w = T (e^G k), u = T v, qg = e^G q (normalised, scaled), kg = e^{G_last - G} k, a_qk [64, 64] (q-k decay
  products, lower incl. diagonal) and decay_last = e^{G_last} (fp32).
Products run on tensor cores: tf32 for bf16/fp16 inputs (whose own rounding is larger), IEEE fp32 for fp32.
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


def _gap(totals, start: int, stop: int):
    """log2-decay from the start of sub-block `start` to the start of sub-block `stop` ([1, K], 0 if empty)."""
    return sum(totals[start:stop], jnp.zeros_like(totals[0]))


def _load_rows(ref, rows, l2norm: bool):
    x = ref[rows, :].astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2_EPS) if l2norm else x


def _store(ref, rows, x):
    ref[rows, :] = x.astype(ref.dtype)


def _store_row_of_blocks(ref, rows, blocks):
    """Row `rows` of a [CHUNK, CHUNK] matrix from its 16x16 blocks up to the diagonal; zeros after it."""
    for j in range(SUBS):
        block = blocks[j] if j < len(blocks) else jnp.zeros((SUB, SUB), jnp.float32)
        ref[rows, pl.ds(j * SUB, SUB)] = block.astype(ref.dtype)


def _sum(terms):
    return functools.reduce(operator.add, terms)


def _block_inverse(strict_L, dots: Dots):
    """(I + L)^-1 as 16x16 blocks X[i][j], j <= i, for the strictly lower [CHUNK, CHUNK] L given as blocks
    L[i][j]: the diagonal blocks' inverses D_i (in lockstep), then X_ij = -D_i sum_{m=j}^{i-1} L_im X_mj."""
    diagonal = unit_lower_inverses([strict_L[i][i] for i in range(SUBS)], dots)
    inverse = []
    for i in range(SUBS):
        inverse.append([-dots.nn(diagonal[i], _sum(dots.nn(strict_L[i][m], inverse[m][j]) for m in range(j, i)))
                        for j in range(i)] + [diagonal[i]])
    return inverse


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, qg_ref, kg_ref, a_ref, decay_ref,
            *, scale, use_qk_l2norm):
    dots = gpu_dots(v_ref.dtype)
    rows = [pl.ds(i * SUB, SUB) for i in range(SUBS)]
    totals = [jnp.sum(g_ref[r, :], axis=0, keepdims=True) * LOG2_E for r in rows]  # [1, K] each
    decay_ref[...] = jnp.exp2(_gap(totals, 0, SUBS))
    lower, strict = _iota(0) >= _iota(1), _iota(0) > _iota(1)
    strict_L, k_to_end, beta_k_decayed = [], [], []  # per sub-block: its row of L; k e^{t_i - Γ}; beta e^G k
    for i, r in enumerate(rows):
        q = _load_rows(q_ref, r, use_qk_l2norm) * scale
        k = _load_rows(k_ref, r, use_qk_l2norm)
        beta = beta_ref[r, :]  # [SUB, 1]
        local = jnp.cumsum(g_ref[r, :] * LOG2_E, axis=0)  # Γ_i [SUB, K], <= 0
        from_start = jnp.exp2(local)  # e^{G_c - o_i} <= 1
        decay = jnp.exp2(_gap(totals, 0, i)) * from_start  # e^{G_c}
        k_right = [k_to_end[j] * jnp.exp2(_gap(totals, j + 1, i)) for j in range(i)]  # k_s e^{o_i - G_s} <= 1
        k_right.append(k * jnp.exp2(-local))  # the diagonal block: <= e^80
        a_qk = [dots.nt(q * from_start, right) for right in k_right]
        a_qk[i] = jnp.where(lower, a_qk[i], 0.0)
        _store_row_of_blocks(a_ref, r, a_qk)
        strict_L.append([beta * dots.nt(k * from_start, right) for right in k_right])
        strict_L[i][i] = jnp.where(strict, strict_L[i][i], 0.0)
        k_to_end.append(k * jnp.exp2(totals[i] - local))
        beta_k_decayed.append(beta * k * decay)
        _store(qg_ref, r, q * decay)
        _store(kg_ref, r, k_to_end[i] * jnp.exp2(_gap(totals, i + 1, SUBS)))
    inverse = _block_inverse(strict_L, dots)
    beta_v = [beta_ref[r, :] * v_ref[r, :].astype(jnp.float32) for r in rows]
    for i, r in enumerate(rows):  # T = (I + L)^-1 diag(beta)
        _store(w_ref, r, _sum(dots.nn(inverse[i][j], beta_k_decayed[j]) for j in range(i + 1)))
        _store(u_ref, r, _sum(dots.nn(inverse[i][j], beta_v[j]) for j in range(i + 1)))


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "parts_dtype", "num_warps", "interpret"))
def intra_chunk(q, k, v, g, beta, *, scale: float, use_qk_l2norm: bool = True, parts_dtype=None,
                num_warps: int = 8, interpret: bool = False) -> ChunkParts:
    """Phase 1 over whole chunks: q, k [B, Tp, H, K], v [B, Tp, H, V], g [B, Tp, H, K] fp32 log-decay,
    beta [B, Tp, H, 1] fp32, Tp a multiple of CHUNK; parts stored as parts_dtype (default v's).
    Grid (B*H, Tp / CHUNK), all programs independent."""
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
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_prefill_intra_chunk",
    )(q, k, v, g, beta))
