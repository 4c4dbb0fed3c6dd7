"""Dequantisation of checkpoint weights to float32 (spec §6.2 block FP8, §6.3 MXFP4), in numpy."""

from __future__ import annotations

import ml_dtypes
import numpy as np

# E2M1 code -> value; codes 8..15 are the negated magnitudes (8 is -0).
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_VALUES = np.concatenate([_E2M1, -_E2M1])
MXFP4_GROUP = 32


def dequantize_fp8_block(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """W[r, c] = fp8[r, c] * scale[r // block_rows, c // block_cols] (`weight_scale_inv` multiplies)."""
    rows, cols = weight.shape
    block_rows, block_cols = block
    expected = (-(-rows // block_rows), -(-cols // block_cols))
    if scale.shape != expected:
        raise ValueError(
            f"block scale has shape {scale.shape}, expected {expected} for a {weight.shape} weight "
            f"with {block_rows}x{block_cols} blocks"
        )
    full_scale = np.repeat(np.repeat(scale.astype(np.float32), block_rows, 0), block_cols, 1)[:rows, :cols]
    return weight.astype(np.float32) * full_scale


def e8m0_to_float(scale: np.ndarray) -> np.ndarray:
    """E8M0 scales as stored: float8_e8m0fnu, raw 8-bit exponents u (2^(u-127), uint8 or int8), or float powers
    of two."""
    if scale.dtype in (np.uint8, np.int8):
        return np.ldexp(np.float32(1.0), scale.view(np.uint8).astype(np.int32) - 127).astype(np.float32)
    return scale.astype(np.float32)


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """MXFP4 bytes [..., n] (uint8 or int8; element 2j in the low nibble of byte j, 2j + 1 in the high one) ->
    E2M1 codes [..., 2n] (uint8 0..15, indices into `E2M1_VALUES`)."""
    codes = np.asarray(packed).view(np.uint8)
    return np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)


def dequantize_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """packed [O, In/2] bytes (element 2j in the low nibble) with one E8M0 scale per 32 inputs [O, In/32]."""
    rows, half = packed.shape
    cols = 2 * half
    expected = (rows, -(-cols // MXFP4_GROUP))  # a partial last group still has its own scale
    if scale.shape != expected:
        raise ValueError(f"MXFP4 scale has shape {scale.shape}, expected {expected} for packed weight {packed.shape}")
    return E2M1_VALUES[unpack_e2m1(packed)] * np.repeat(e8m0_to_float(scale), MXFP4_GROUP, axis=1)[:, :cols]


def is_float8(dtype: np.dtype) -> bool:
    return dtype in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
