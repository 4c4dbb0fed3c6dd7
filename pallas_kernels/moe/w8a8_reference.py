"""The W8A8 routed-expert ops in jnp: the spec of `gpu_triton/w8a8.py` and what a backend without the kernels runs.

Block-FP8 expert weights W [G, N, K] (e4m3 values, fp32 scales per block[0] x block[1] block, spec §6.2); the
activations quantised per token in 1 x block[1] groups (`fp8.reference.quantize_activations`: scale = amax / 448,
e4m3 rounding); every product is the FP8 product of the quantised operands times both scales, summed in fp32,
which is the product of the dequantised operands (computed so, at HIGHEST precision). h, the SwiGLU output, is
quantised the same way before the down product.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.fp8.reference import dequantize_blocks, quantize_activations
from pallas_kernels.moe.reference import down_scatter_reference, gather_swiglu_reference


def _dequantized_activations(x_MK, group: int):
    x_q_MK, scale_MG = quantize_activations(x_MK, group)
    return dequantize_blocks(x_q_MK, scale_MG, (1, group), jnp.float32)


def gather_swiglu_w8a8_reference(
    x_XD, source_R, group_sizes_G, gate_values_GID, gate_scales, up_values_GID, up_scales, limit, *, block
):
    """(h_q [R, I] e4m3, h_scale [R, ceil(I / block[1])] fp32) as `gather_swiglu_w8a8_gpu` returns them: x
    quantised, its products with the block-FP8 gate and up in fp32, SwiGLU, h quantised; rows past
    sum(group_sizes) give h = 0."""
    gate_GID, up_GID = (
        dequantize_blocks(values, scales, block, jnp.float32)
        for values, scales in ((gate_values_GID, gate_scales), (up_values_GID, up_scales))
    )
    x_XD = _dequantized_activations(x_XD, block[1])
    h_RI = gather_swiglu_reference(x_XD, source_R, group_sizes_G, gate_GID, up_GID, limit)
    return quantize_activations(h_RI, block[1])


def down_scatter_w8a8_reference(
    h_q_RI, h_scale, dest_R, row_weight_R, group_sizes_G, down_values_GDI, down_scales, *, block, out_dtype=jnp.bfloat16
):
    """y [R, D] of out_dtype as `down_scatter_w8a8_gpu`: h dequantised from (h_q, h_scale), its product with the
    block-FP8 down in fp32, weighted per row and stored to dest[r]; rows past sum(group_sizes) give zeros."""
    h_RI = dequantize_blocks(h_q_RI, h_scale, (1, block[1]), jnp.float32)
    down_GDI = dequantize_blocks(down_values_GDI, down_scales, block, jnp.float32)
    return down_scatter_reference(h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI).astype(out_dtype)


def w8a8_expert_rows_reference(
    x_XD, source_R, order_R, row_weight_R, sizes_E, gate, up, down, limit, *, fill_tail=True, interpret=False
):
    """[R, D] in x's dtype as `gpu_triton.w8a8.w8a8_expert_rows`: the two ops above in turn on three block-FP8
    expert stacks (anything with `values`, `scales` and `block`; one block). fill_tail and interpret are the
    kernels' (the reference always zeroes the tail rows)."""
    del fill_tail, interpret
    block = tuple(gate.block)
    h_q, h_scale = gather_swiglu_w8a8_reference(
        x_XD, source_R, sizes_E, gate.values, gate.scales, up.values, up.scales, limit, block=block
    )
    return down_scatter_w8a8_reference(
        h_q, h_scale, order_R, row_weight_R, sizes_E, down.values, down.scales, block=block, out_dtype=x_XD.dtype
    )
