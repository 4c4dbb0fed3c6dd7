"""Grouped matmul on TPU with dense, block-FP8 or MXFP4 expert weights: a Pallas Mosaic kernel over rows sorted
by expert, the weight tile dequantised in VMEM (`pallas_kernels.tpu_dequant`: FP8 read as e4m3 bytes, MXFP4
as packed nibbles with E8M0 scales per 32 inputs; bf16 MXU products, fp32 accumulation).

Why not jax's own megablox `gmm` (jax.experimental.pallas.ops.tpu.megablox, jax 0.10.2): its rhs must be bf16
or fp32 (no FP8, no packed FP4, no scales), so the stack would be dequantised whole first; nor tokamax's
`ragged_dot` (needs Python >= 3.12 and jax >= 0.11.1). See docs/kernels.md.

The schedule follows megablox's: a visit is (expert, row tile) for every row tile an expert's rows touch, in
row order, so a tile that two experts share is visited twice in a row and its output block stays in VMEM
between the two; each visit stores only its expert's rows. Row tiles past the last expert's rows get one visit
that stores zeros, with the previous visit's weight and x block indices (no DMA). Grid (output tiles,
visits): the visit count is traced (scalar-prefetched metadata), so an empty expert costs nothing; a tile of
W is [block_n, K] as stored, all of K (expert K is at most a few thousand).

Tiles (`BLOCK_M`, `FEW_ROWS_BLOCK_M`, `BLOCK_N`) are not measured (no TPU was available): 128-row tiles for
prefill, 16 rows when the experts average a few rows each (decode: a visit then streams one expert's weight
tile for its one or two rows), 256 output features.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu_dequant
from pallas_kernels.backend import with_reference_vjp
from pallas_kernels.moe.reference import grouped_matmul_reference
from pallas_kernels.moe.tuned import rows_bucket

BLOCK_M = 128
FEW_ROWS_BLOCK_M = 16
BLOCK_N = 256


def visit_schedule(group_sizes_G, num_rows: int, block_m: int):
    """The visits of the grouped kernel (module docstring): (weight_V, x_tile_V, out_tile_V, row_lo_V,
    row_hi_V) int32 [V], V = tiles + G - 1 (the most there can be), and the traced visit count. Visit v
    multiplies x's row tile x_tile[v] by weight[v] and stores rows [row_lo[v], row_hi[v]) of out tile
    out_tile[v] (an empty range: zeros)."""
    num_groups = group_sizes_G.shape[0]
    num_tiles = pl.cdiv(num_rows, block_m)
    sizes = group_sizes_G.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts, total = ends - sizes, ends[-1]
    used_tiles = (total + block_m - 1) // block_m
    counts = jnp.where(sizes > 0, (ends - 1) // block_m - starts // block_m + 1, 0)
    counts_ext = jnp.append(counts, num_tiles - used_tiles)  # entry G: the zero-filled tail tiles
    owner_V = jnp.repeat(
        jnp.arange(num_groups + 1, dtype=jnp.int32), counts_ext, total_repeat_length=num_tiles + num_groups - 1
    )
    first_visit = jnp.cumsum(counts_ext) - counts_ext
    nth_visit_V = jnp.arange(owner_V.shape[0]) - first_visit[owner_V]
    out_tile_V = jnp.append(starts // block_m, used_tiles)[owner_V] + nth_visit_V
    row_lo_V = jnp.append(starts, total)[owner_V]
    row_hi_V = jnp.append(ends, total)[owner_V]
    tail_V = owner_V == num_groups
    last_group = jnp.max(jnp.where(sizes > 0, jnp.arange(num_groups, dtype=jnp.int32), 0))
    weight_V = jnp.where(tail_V, last_group, owner_V)
    x_tile_V = jnp.where(tail_V, jnp.maximum(used_tiles - 1, 0), out_tile_V)
    schedule = tuple(a.astype(jnp.int32) for a in (weight_V, x_tile_V, out_tile_V, row_lo_V, row_hi_V))
    return schedule, jnp.sum(counts_ext)


def _kernel(weight_V, x_tile_V, out_tile_V, row_lo_V, row_hi_V, x_ref, w_ref, *rest, fmt, block_m: int):
    *scale_ref, out_ref = rest
    v = pl.program_id(1)
    lo, hi, tile = row_lo_V[v], row_hi_V[v], out_tile_V[v]
    first_visit = jnp.logical_or(v == 0, tile != out_tile_V[jnp.maximum(v - 1, 0)])

    @pl.when(lo < hi)
    def _store_group_rows():
        product = tpu_dequant.dequantized_product(x_ref, w_ref, scale_ref[0] if scale_ref else None, fmt)
        rows = tile * block_m + jax.lax.broadcasted_iota(jnp.int32, product.shape, 0)
        earlier = jnp.where(first_visit, 0.0, out_ref[...].astype(jnp.float32))
        out_ref[...] = jnp.where((rows >= lo) & (rows < hi), product, earlier).astype(out_ref.dtype)

    @pl.when(lo >= hi)
    def _zero_tail():
        out_ref[...] = jnp.zeros_like(out_ref)


def _block_m(num_rows: int, num_groups: int) -> int:
    block_m = FEW_ROWS_BLOCK_M if rows_bucket(num_rows, num_groups) == "few_rows" else BLOCK_M
    return min(block_m, num_rows)  # a tile of all rows when there are fewer (a legal block of any size)


def grouped_matmul_tpu(lhs_MK, rhs_GNK, group_sizes_G, *, block_m=None, block_n=None, interpret=False):
    """out [M, N] in lhs's dtype (fp32 accumulation): out[rows of g] = lhs[rows of g] @ W[g]^T, rows past
    sum(group_sizes) zeros. lhs [M, K] sorted by group; rhs: a dense [G, N, K] array, or a quantised stack
    (block FP8 with per-expert scale grids, or MXFP4; `tpu_dequant.describe`); group_sizes int32 [G], traced,
    sum <= M. block_m, block_n: tile overrides (None: the module's, shrunk to fit VMEM)."""
    stored = tpu_dequant.describe(rhs_GNK)
    fmt = stored.fmt
    if stored.values.ndim != 3 or not tpu_dequant.kernel_takes(stored):
        raise ValueError(
            f"rhs: expected a [G, N, K] stack in a format the TPU kernel takes, got {fmt} "
            f"of shape {stored.values.shape}"
        )
    num_rows, k_dim = lhs_MK.shape
    num_groups, out_features, k_stored = stored.values.shape
    if k_dim != stored.in_features or group_sizes_G.shape != (num_groups,):
        raise ValueError(
            f"lhs [M, {k_dim}], group_sizes {group_sizes_G.shape}: expected K = {stored.in_features} "
            f"and [{num_groups}] group sizes for rhs of {num_groups} groups"
        )
    block_m = block_m or _block_m(num_rows, num_groups)
    block_n = tpu_dequant.block_n_for(fmt, block_n or BLOCK_N, out_features)
    block_m, block_n = tpu_dequant.fit_tiles(block_m, block_n, stored, lhs_MK.dtype, lhs_MK.dtype)
    block_n = tpu_dequant.block_n_for(fmt, block_n, out_features)
    schedule, num_visits = visit_schedule(group_sizes_G, num_rows, block_m)

    operands = [tpu_dequant.x_parts(lhs_MK, fmt), stored.values]
    in_specs = [
        pl.BlockSpec((fmt.parts, block_m, k_stored), lambda n, v, w, xt, *_: (0, xt[v], 0)),
        pl.BlockSpec((None, block_n, k_stored), lambda n, v, w, *_: (w[v], n, 0)),
    ]
    if fmt.scaled:
        scales = tpu_dequant.scale_operand(stored)
        shape = tpu_dequant.scale_block_shape(fmt, block_n, scales.shape[-1])
        operands.append(scales)
        trailing = (0,) * (len(shape) - 1)
        in_specs.append(pl.BlockSpec((None, *shape), lambda n, v, w, *_: (w[v], n, *trailing)))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(schedule),
        grid=(pl.cdiv(out_features, block_n), num_visits),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda n, v, w, xt, ot, *_: (ot[v], n)),
    )
    return pl.pallas_call(
        functools.partial(_kernel, fmt=fmt, block_m=block_m),
        out_shape=jax.ShapeDtypeStruct((num_rows, out_features), lhs_MK.dtype),
        grid_spec=grid_spec,
        compiler_params=tpu_dequant.compiler_params(("parallel", "arbitrary")),
        cost_estimate=tpu_dequant.cost_estimate(lhs_MK, stored, x_reads=pl.cdiv(out_features, block_n)),
        interpret=interpret,
    )(*schedule, *operands)


def _reference(lhs_MK, rhs_GNK, group_sizes_G, interpret):
    return grouped_matmul_reference(lhs_MK, tpu_dequant.as_dense(rhs_GNK, lhs_MK.dtype), group_sizes_G)


# The op's TPU path: the kernel, differentiated as dequantise-then-ragged-dot (in lhs, and in a dense rhs).
grouped_matmul_tpu_op = with_reference_vjp(
    lambda lhs, rhs, sizes, interpret: grouped_matmul_tpu(lhs, rhs, sizes, interpret=interpret),
    _reference,
    nondiff_argnums=(3,),
)
