"""Per-tensor transforms from checkpoint storage to stored parameter, kept apart from the IO loop.

`to_dense` casts plain rows and dequantises block-FP8 and MXFP4 rows; `to_fp8` keeps FP8 rows with their
block scales and turns MXFP4 rows into FP8 codes (every E2M1 value is exact in E4M3) with one scale per 32
inputs, so a checkpoint kept in FP8 is dequantised by one function at load time
(`ling_jax.quantized.dequantize_blocks`). The quantised paths run on the JAX CPU backend: the numpy
versions in `ling_jax.quant` manage ~0.13 G elements/s here, XLA's fused kernel ~1.2.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from convert.source import SourceRows, SourceTensor
from ling_jax.checkpoints.storage import FP8, MXFP4, PLAIN
from ling_jax.quant import E2M1_VALUES
from ling_jax.quantized import dequantize_blocks

FP8_CODE_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
_E2M1_AS_FP8 = E2M1_VALUES.astype(FP8_CODE_DTYPE)


def _mxfp4_codes(packed, cols: int):
    """Packed bytes [..., ceil(cols/2)] (element 2j in the low nibble) -> E4M3 codes [..., cols]."""
    codes = jax.lax.bitcast_convert_type(packed, jnp.uint8)
    nibbles = jnp.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
    return jnp.asarray(_E2M1_AS_FP8)[nibbles[..., :cols]]


@partial(jax.jit, static_argnames=("block", "dtype"))
def _dequantize_fp8(values, scale, *, block, dtype):
    return dequantize_blocks(values, scale, block, dtype)


@partial(jax.jit, static_argnames=("block", "cols", "dtype"))
def _dequantize_mxfp4(packed, scale, *, block, cols, dtype):
    return dequantize_blocks(_mxfp4_codes(packed, cols), scale, block, dtype)


_fp8_codes_of_mxfp4 = jax.jit(_mxfp4_codes, static_argnames=("cols",))


def to_dense(rows: SourceRows, source: SourceTensor, dtype: np.dtype) -> np.ndarray:
    """The rows' real values in `dtype`."""
    if source.kind == PLAIN:
        return rows.values.astype(dtype, copy=False)
    if source.kind == FP8:
        return np.asarray(_dequantize_fp8(rows.values, rows.scale, block=source.block, dtype=dtype))
    if source.kind == MXFP4:
        return np.asarray(
            _dequantize_mxfp4(rows.values, rows.scale, block=source.block, cols=source.shape[-1], dtype=dtype)
        )
    raise ValueError(f"unknown source kind {source.kind!r}")


def to_fp8(rows: SourceRows, source: SourceTensor) -> tuple[np.ndarray, np.ndarray]:
    """(FP8 values, float32 scales, one per `source.block`) of quantised rows."""
    if source.kind == FP8:
        return rows.values, rows.scale
    if source.kind == MXFP4:
        return np.asarray(_fp8_codes_of_mxfp4(rows.values, cols=source.shape[-1])), rows.scale
    raise ValueError(f"'{source.name}' is not quantised; it cannot be kept in FP8")
