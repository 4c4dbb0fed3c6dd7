"""Weight-only block-FP8 linear map on TPU: a Pallas Mosaic kernel, y = x @ W^T for a block-FP8 weight W.

Grid (row tiles, output tiles), both parallel: each step DMAs a [block_n, K] tile of W as stored (e4m3 bytes,
half the bf16 bytes) with the scales covering it, and x's [block_m, K] rows (kept in VMEM across the output
tiles of a row tile); the tile is decoded, scaled and cast to x's dtype in VMEM 128 inputs at a time
(`pallas_kernels.tpu_dequant`) and multiplied on the MXU with fp32 accumulation. A decode call (a few rows)
is one row tile of exactly its rows: no padding. W8A8 has no TPU kernel: v5e / v6e have no FP8 matrix unit.

Tiles: `tuned.TPU` (not measured: no TPU was available), shrunk to fit `tpu_dequant.TILE_BUDGET_BYTES` for long K.
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl

from pallas_kernels import tpu_dequant
from pallas_kernels.fp8 import tuned
from pallas_kernels.tuning import lookup


def takes(x, weight) -> bool:
    """Whether the kernel runs this product: a 2-D block-FP8 weight whose scale blocks it handles
    (`tpu_dequant.kernel_takes`) and a bf16 or fp32 activation (a TPU has no fp16 arithmetic)."""
    stored = tpu_dequant.block_fp8(weight.values, weight.scales, tuple(weight.block))
    return (
        weight.values.ndim == 2
        and tpu_dequant.kernel_takes(stored)
        and jax.numpy.dtype(x.dtype) in (jax.numpy.dtype(jax.numpy.bfloat16), jax.numpy.dtype(jax.numpy.float32))
    )


def _kernel(x_ref, w_ref, *rest, fmt: tpu_dequant.TileFormat):
    *scale_ref, out_ref = rest
    product = tpu_dequant.dequantized_product(x_ref, w_ref, scale_ref[0] if scale_ref else None, fmt)
    out_ref[...] = product.astype(out_ref.dtype)


def stored_linear(x_MK, stored: tpu_dequant.StoredWeight, *, tiles: tuned.TpuTiles | None = None, interpret=False):
    """y [M, N] in x's dtype = x [M, K] @ W^T for any stored weight W [N, K] (`tpu_dequant.describe`). Tiles: None
    from `tuned.TPU`."""
    tiles = tiles or lookup(tuned.TPU, dtype=x_MK.dtype)
    fmt = stored.fmt
    num_rows, k_dim = x_MK.shape
    if k_dim != stored.in_features:
        raise ValueError(f"x: expected {stored.in_features} input features (the weight's), got {k_dim}")
    out_features, k_stored = stored.out_features, stored.values.shape[-1]
    block_m = min(tiles.block_m, num_rows)
    block_n = tpu_dequant.block_n_for(fmt, tiles.block_n, out_features)
    block_m, block_n = tpu_dequant.fit_tiles(block_m, block_n, stored, x_MK.dtype, x_MK.dtype)
    block_n = tpu_dequant.block_n_for(fmt, block_n, out_features)
    operands = [tpu_dequant.x_parts(x_MK, fmt), stored.values]
    in_specs = [
        pl.BlockSpec((fmt.parts, block_m, k_stored), lambda i, j: (0, i, 0)),
        pl.BlockSpec((block_n, k_stored), lambda i, j: (j, 0)),
    ]
    if fmt.scaled:
        scales = tpu_dequant.scale_operand(stored)
        shape = tpu_dequant.scale_block_shape(fmt, block_n, scales.shape[-1])
        operands.append(scales)
        in_specs.append(pl.BlockSpec(shape, lambda i, j: (j,) + (0,) * (len(shape) - 1)))
    return pl.pallas_call(
        lambda *refs: _kernel(*refs, fmt=fmt),
        out_shape=jax.ShapeDtypeStruct((num_rows, out_features), x_MK.dtype),
        grid=(pl.cdiv(num_rows, block_m), pl.cdiv(out_features, block_n)),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        compiler_params=tpu_dequant.compiler_params(("parallel", "parallel")),
        cost_estimate=tpu_dequant.cost_estimate(x_MK, stored, x_reads=1),
        interpret=interpret,
    )(*operands)


def weight_only_linear_tpu(
    x_MK, values_NK, scales, *, block: tuple[int, int], tiles: tuned.TpuTiles | None = None, interpret=False
):
    """y [M, N] in x's dtype = x [M, K] @ W^T, W [N, K] = e4m3 values [N, K] times fp32 scales
    [ceil(N / block[0]), ceil(K / block[1])] (spec §6.2), dequantised in VMEM; fp32 accumulation.
    Tiles: None from `tuned.TPU`, shrunk to fit VMEM."""
    stored = tpu_dequant.block_fp8(values_NK, scales, tuple(block))
    if not tpu_dequant.kernel_takes(stored):
        raise ValueError(
            f"weight_only_linear_tpu: scale blocks {tuple(block)} are not handled (rows 1 or 8k, "
            "columns dividing or a multiple of 128)"
        )
    return stored_linear(x_MK, stored, tiles=tiles, interpret=interpret)
