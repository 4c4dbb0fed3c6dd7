"""KDA prefill on GPU, phase 1, kernels 3 and 4 of 4: the per-token factors of a chunk (Pallas, Triton lowering),
each over column blocks of the keys or values. With X = (I + L)^-1 from `chunk_gpu_tril.merge_inverse` and G
the chunk-local cumulative log-decay (<= 0, log2 units for exp2), for the columns of block c:
  `key_factors`, grid (K / block, B*H, T/64): w = X (beta e^G k) ([64, 64] x [64, block] product),
      kg = e^{G_last - G} k (by 16-row sub-blocks, for precision), decay_last = e^{G_last} (fp32);
  `value_factors`, grid (V / block, B*H, T/64): u = X (beta v).
The keys come with their inverse l2 norms from the block-row kernel (a column block does not see whole rows).
Every exponent is <= 0 (an e^G that underflows to 0 is the true value rounded): nothing can overflow.
Column blocks keep each program's fp32 tiles small ([64, block]), so more programs fit an SM at once: with a
whole [64, 128] chunk per program (8 warps) this work ran at ~1 TB/s on an H200, likely one program per SM
for its registers. The column block is the fastest grid axis (Triton's x), so the blocks of a chunk run
together and share X in L2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda.chunk_gpu_blocks import LOG2_E
from pallas_kernels.kda.chunk_gpu_tril import CHUNK, SUBS, block_lower_mask, gpu_dots, sub_rows


def _inverse(inverse_ref):
    """X [CHUNK, CHUNK]: its blocks above the diagonal are unwritten, loaded as zeros."""
    return plgpu.load(inverse_ref, mask=block_lower_mask(), other=0.0)


def _store_keys_to_end(k_ref, key_scale_ref, g_ref, kg_ref):
    """kg = k e^{G_last - G}, a 16-row sub-block i at a time, as e^{(t_i - Γ_i) + t_{i+1} + ... + t_3}
    (Γ_i its cumulative log-decay, t_i its total): G_last - G_c for a row near the end is not then the
    difference of two sums of up to 64 gates (whose fp32 rounding, ~|G_last| ulp, made kg 1e-4-wrong)."""
    suffix_1B = jnp.zeros((1, k_ref.shape[1]), jnp.float32)
    for i in reversed(range(SUBS)):
        g_SUBB = g_ref[sub_rows(i), :] * LOG2_E
        total_1B = jnp.sum(g_SUBB, axis=0, keepdims=True)
        decay_SUBB = jnp.exp2(total_1B - jnp.cumsum(g_SUBB, axis=0) + suffix_1B)
        keys_SUBB = k_ref[sub_rows(i), :].astype(jnp.float32) * key_scale_ref[sub_rows(i), :]
        kg_ref[sub_rows(i), :] = (keys_SUBB * decay_SUBB).astype(kg_ref.dtype)
        suffix_1B = suffix_1B + total_1B


def _keys_kernel(k_ref, key_scale_ref, g_ref, beta_ref, inverse_ref, w_ref, kg_ref, decay_ref, *, input_dtype):
    g_CB = g_ref[...] * LOG2_E
    decay_ref[...] = jnp.exp2(jnp.sum(g_CB, axis=0, keepdims=True))  # e^{G_last}
    _store_keys_to_end(k_ref, key_scale_ref, g_ref, kg_ref)
    scaled_C1 = beta_ref[...] * key_scale_ref[...]
    keys_CB = k_ref[...].astype(jnp.float32) * scaled_C1 * jnp.exp2(jnp.cumsum(g_CB, axis=0))  # beta e^G k
    w_ref[...] = gpu_dots(input_dtype).nn(_inverse(inverse_ref), keys_CB).astype(w_ref.dtype)


def _values_kernel(v_ref, beta_ref, inverse_ref, u_ref, *, input_dtype):
    values_CB = beta_ref[...] * v_ref[...].astype(jnp.float32)
    u_ref[...] = gpu_dots(input_dtype).nn(_inverse(inverse_ref), values_CB).astype(u_ref.dtype)


def _specs(heads: int, block: int):
    """BlockSpecs over grid (column block c, bh, chunk n): (a [B, Tp, H, width] input's columns c, a [B, Tp, H,
    width] input whole (width 1 here), a [BH, Tp, width] array's whole rows, a [BH, Tp, width] output's columns c)."""
    columns = pl.BlockSpec((None, CHUNK, None, block), lambda c, bh, n: (bh // heads, n, bh % heads, c))
    beta = pl.BlockSpec((None, CHUNK, None, 1), lambda c, bh, n: (bh // heads, n, bh % heads, 0))
    rows = lambda width: pl.BlockSpec((None, CHUNK, width), lambda c, bh, n: (bh, n, 0))  # noqa: E731
    out_columns = pl.BlockSpec((None, CHUNK, block), lambda c, bh, n: (bh, n, c))
    return columns, beta, rows, out_columns


def key_factors(k, key_scale, g, beta, inverse, *, parts_dtype, block: int = 64, num_warps: int = 4,
                num_stages: int = 1, interpret: bool = False):
    """(w, kg [BH, Tp, K] parts_dtype, decay_last [BH, N, 1, K] fp32) from k [B, Tp, H, K], key_scale
    [BH, Tp, 1] fp32 (the keys' inverse l2 norms, or ones), g [B, Tp, H, K] fp32, beta [B, Tp, H, 1] fp32 and
    inverse [BH, Tp, CHUNK] fp32. Grid (K / block, B*H, N = Tp / CHUNK)."""
    batch, padded, heads, key_dim = k.shape
    flat, num_chunks, block = batch * heads, padded // CHUNK, min(block, key_dim)
    columns, beta_spec, rows, out_columns = _specs(heads, block)
    return pl.pallas_call(
        functools.partial(_keys_kernel, input_dtype=k.dtype),
        grid=(pl.cdiv(key_dim, block), flat, num_chunks),
        in_specs=[columns, rows(1), columns, beta_spec, rows(CHUNK)],
        out_specs=[out_columns, out_columns,
                   pl.BlockSpec((None, None, 1, block), lambda c, bh, n: (bh, n, 0, c))],
        out_shape=[jax.ShapeDtypeStruct((flat, padded, key_dim), parts_dtype)] * 2
        + [jax.ShapeDtypeStruct((flat, num_chunks, 1, key_dim), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_prefill_intra_key_factors",
    )(k, key_scale, g, beta, inverse)


def value_factors(v, beta, inverse, *, parts_dtype, block: int = 64, num_warps: int = 4, num_stages: int = 1,
                  interpret: bool = False):
    """u [BH, Tp, V] parts_dtype from v [B, Tp, H, V], beta [B, Tp, H, 1] fp32 and inverse [BH, Tp, CHUNK]
    fp32. Grid (V / block, B*H, N)."""
    batch, padded, heads, value_dim = v.shape
    block = min(block, value_dim)
    columns, beta_spec, rows, out_columns = _specs(heads, block)
    return pl.pallas_call(
        functools.partial(_values_kernel, input_dtype=v.dtype),
        grid=(pl.cdiv(value_dim, block), batch * heads, padded // CHUNK),
        in_specs=[columns, beta_spec, rows(CHUNK)],
        out_specs=out_columns,
        out_shape=jax.ShapeDtypeStruct((batch * heads, padded, value_dim), parts_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_prefill_intra_value_factors",
    )(v, beta, inverse)
