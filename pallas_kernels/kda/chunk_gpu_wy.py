"""KDA prefill on GPU, phase 1, kernel 3 of 3: the per-token factors of a chunk (Pallas, Triton lowering).
Grid (B*H, T/64): program (bh, n) takes chunk n whole, with X = (I + L)^-1 from `chunk_gpu_tril.merge_inverse`,
and with G the chunk-local cumulative log-decay (<= 0, log2 units for exp2) stores
  w = X (beta e^G k), u = X (beta v)   (two [64, 64] x [64, K or V] products),
  kg = e^{G_last - G} k (by 16-row sub-blocks, for precision) and decay_last = e^{G_last} (fp32).
Every exponent is <= 0 (an e^G that underflows to 0 is the true value rounded): nothing can overflow.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda.chunk_gpu_blocks import LOG2_E, normalised
from pallas_kernels.kda.chunk_gpu_tril import CHUNK, SUBS, block_lower_mask, gpu_dots, sub_rows


def _store_keys_to_end(k_ref, g_ref, kg_ref, l2norm):
    """kg = k e^{G_last - G}, a 16-row sub-block i at a time, as e^{(t_i - Γ_i) + t_{i+1} + ... + t_3}
    (Γ_i its cumulative log-decay, t_i its total): G_last - G_c for a row near the end is not then the
    difference of two sums of up to 64 gates (whose fp32 rounding, ~|G_last| ulp, made kg 1e-4-wrong)."""
    suffix_1K = jnp.zeros((1, k_ref.shape[1]), jnp.float32)
    for i in reversed(range(SUBS)):
        g_SUBK = g_ref[sub_rows(i), :] * LOG2_E
        total_1K = jnp.sum(g_SUBK, axis=0, keepdims=True)
        decay_SUBK = jnp.exp2(total_1K - jnp.cumsum(g_SUBK, axis=0) + suffix_1K)
        kg_ref[sub_rows(i), :] = (normalised(k_ref[sub_rows(i), :], l2norm) * decay_SUBK).astype(kg_ref.dtype)
        suffix_1K = suffix_1K + total_1K


def _kernel(k_ref, v_ref, g_ref, beta_ref, inverse_ref, w_ref, u_ref, kg_ref, decay_ref, *, l2norm, input_dtype):
    dots = gpu_dots(input_dtype)
    g_CK = g_ref[...] * LOG2_E
    log_decay_CK = jnp.cumsum(g_CK, axis=0)  # G
    last_1K = jnp.sum(g_CK, axis=0, keepdims=True)  # G_last
    decay_ref[...] = jnp.exp2(last_1K)
    beta_C1 = beta_ref[...]
    inverse_CC = plgpu.load(inverse_ref, mask=block_lower_mask(), other=0.0)  # above its blocks: unwritten
    u_ref[...] = dots.nn(inverse_CC, beta_C1 * v_ref[...].astype(jnp.float32)).astype(u_ref.dtype)
    _store_keys_to_end(k_ref, g_ref, kg_ref, l2norm)
    k_CK = normalised(k_ref[...], l2norm)
    from_start_CK = jnp.exp2(log_decay_CK)
    w_ref[...] = dots.nn(inverse_CC, beta_C1 * k_CK * from_start_CK).astype(w_ref.dtype)


def chunk_factors(k, v, g, beta, inverse, *, use_qk_l2norm: bool, parts_dtype, num_warps: int = 8,
                  num_stages: int = 1, interpret: bool = False):
    """(w, u, kg [BH, Tp, K or V] parts_dtype, decay_last [BH, N, 1, K] fp32) from k [B, Tp, H, K],
    v [B, Tp, H, V], g [B, Tp, H, K] fp32, beta [B, Tp, H, 1] fp32 and inverse [BH, Tp, CHUNK] fp32.
    Grid (B*H, N = Tp / CHUNK)."""
    batch, padded, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    flat, num_chunks = batch * heads, padded // CHUNK
    source = lambda width: pl.BlockSpec(  # noqa: E731
        (None, CHUNK, None, width), lambda bh, n: (bh // heads, n, bh % heads, 0))
    target = lambda width: pl.BlockSpec((None, CHUNK, width), lambda bh, n: (bh, n, 0))  # noqa: E731
    per_token = lambda width: jax.ShapeDtypeStruct((flat, padded, width), parts_dtype)  # noqa: E731
    return pl.pallas_call(
        functools.partial(_kernel, l2norm=use_qk_l2norm, input_dtype=v.dtype),
        grid=(flat, num_chunks),
        in_specs=[source(key_dim), source(value_dim), source(key_dim), source(1), target(CHUNK)],
        out_specs=[target(key_dim), target(value_dim), target(key_dim),
                   pl.BlockSpec((None, None, 1, key_dim), lambda bh, n: (bh, n, 0, 0))],
        out_shape=[per_token(key_dim), per_token(value_dim), per_token(key_dim),
                   jax.ShapeDtypeStruct((flat, num_chunks, 1, key_dim), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_prefill_intra_factors",
    )(k, v, g, beta, inverse)
