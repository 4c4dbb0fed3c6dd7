"""Block-FP8 linear maps in jnp: the spec of the FP8 kernels (spec §6.2) and what runs on a CPU.

A block-FP8 weight W [O, In] is stored as e4m3 values [O, In] and fp32 scales [ceil(O / br), ceil(In / bc)] for
blocks of br x bc weights: W[o, i] = values[o, i] * scales[o // br, i // bc] (the checkpoint's
`weight_scale_inv` multiplies); edge blocks may be partial.

- weight-only: y = x @ W^T with W dequantised to x's dtype (what a layer did before the kernels existed);
- W8A8: x quantised per token in 1 x bc groups (the weight's K block): a_scale[m, g] = amax_i |x[m, i]| / 448
  over the group's inputs (at least EPS / 448, so an all-zero group has a finite scale), x_q = e4m3(x / a_scale)
  (round to nearest even, clipped to +-448), then y[m, o] = sum_g (x_q[m, g] . values[o, g]) * a_scale[m, g] *
  scales[o // br, g], accumulated in fp32.

The decode gemv's prologue (`GatedHeadNorm`): x's rows normalised head by head before the product, KDA's gated
output norm (`gated_head_norm`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda.reference import gated_output_norm

E4M3_MAX = 448.0
EPS = 1e-10  # the smallest group amax a scale is taken from (an all-zero group quantises to zeros)


def dequantize_blocks(values, scales, block: tuple[int, int], dtype) -> jax.Array:
    """W[..., r, c] = values[..., r, c] * scales[..., r // block_rows, c // block_cols], cast to `dtype`.

    Edge blocks may be partial. Computed in float32 then cast once, as `ling_jax.quant.dequantize_fp8_block`."""
    rows, cols = values.shape[-2:]
    block_rows, block_cols = block
    full_scales = jnp.repeat(jnp.repeat(scales.astype(jnp.float32), block_rows, axis=-2), block_cols, axis=-1)
    return (values.astype(jnp.float32) * full_scales[..., :rows, :cols]).astype(dtype)


def quantize_groups(x_C) -> tuple[jax.Array, jax.Array]:
    """(x_q float8_e4m3fn like x, scale float32 [...]): x [..., C] quantised as groups along its last axis, each
    scaled so that its largest magnitude maps to 448 (module docstring). Also the epilogue of the W8A8 MoE
    kernels, on a tile of one group's columns."""
    x_C = x_C.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(x_C), axis=-1), EPS) / E4M3_MAX
    x_q_C = jnp.clip(x_C / scale[..., None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return x_q_C, scale


def quantize_activations(x_MK, group: int) -> tuple[jax.Array, jax.Array]:
    """(x_q [M, K] float8_e4m3fn, a_scale [M, ceil(K / group)] float32): per-token 1 x group quantisation
    (`quantize_groups`; a partial last group is padded with zeros)."""
    num_rows, k_dim = x_MK.shape
    num_groups = -(-k_dim // group)
    x_MGC = jnp.pad(x_MK, ((0, 0), (0, num_groups * group - k_dim))).reshape(num_rows, num_groups, group)
    x_q_MGC, scale_MG = quantize_groups(x_MGC)
    return x_q_MGC.reshape(num_rows, num_groups * group)[:, :k_dim], scale_MG


def weight_only_linear_reference(x_MK, values_NK, scales, block: tuple[int, int]) -> jax.Array:
    """y [M, N] in x's dtype: x @ W^T, W dequantised to x's dtype first (the layers' path before the kernels)."""
    return jnp.einsum("mk,nk->mn", x_MK, dequantize_blocks(values_NK, scales, block, x_MK.dtype))


def w8a8_linear_reference(x_MK, values_NK, scales, block: tuple[int, int]) -> jax.Array:
    """y [M, N] in x's dtype: x quantised per token (`quantize_activations`, groups of the weight's K block), the
    FP8 product of each K block scaled by both block scales, summed in fp32."""
    x_q_MK, a_scale_MG = quantize_activations(x_MK, block[1])
    x_MK_dequantized = dequantize_blocks(x_q_MK, a_scale_MG, (1, block[1]), jnp.float32)
    w_NK = dequantize_blocks(values_NK, scales, block, jnp.float32)
    y_MN = jnp.dot(x_MK_dequantized, w_NK.T, precision=jax.lax.Precision.HIGHEST)
    return y_MN.astype(x_MK.dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("gate", "weight_D"), meta_fields=("eps",))
@dataclasses.dataclass(frozen=True)
class GatedHeadNorm:
    """KDA's gated output norm of a product's input x [..., K], heads of D = weight_D's size side by side along K:
    the gate's pre-activation (x's shape), the norm weight [D] (every head's), the norm's eps (`gated_head_norm`)."""

    gate: jax.Array
    weight_D: jax.Array
    eps: float


def gated_head_norm(x, norm: GatedHeadNorm) -> jax.Array:
    """x [..., K] normalised head by head (`pallas_kernels.kda.reference.gated_output_norm` over each D values:
    fp32, cast to x's dtype)."""
    head_dim = norm.weight_D.shape[0]
    x_HD, gate_HD = (a.reshape(*a.shape[:-1], -1, head_dim) for a in (x, norm.gate))
    return gated_output_norm(x_HD, gate_HD, norm.weight_D, norm.eps).reshape(x.shape)


def is_quantized(weight) -> bool:
    """A quantised weight (block FP8 or MXFP4: anything with `values` and `scales`), not a dense array."""
    return hasattr(weight, "values") and hasattr(weight, "scales")
