"""The routed-expert FFN in W8A8 on Hopper as persistent, warp-specialised Pallas Mosaic GPU kernels (TMA, e4m3
wgmma): `w8a8_expert_rows_mgpu`.

The arithmetic of `moe.w8a8_reference` (x and h quantised per token in 1 x 128 groups, FP8 products scaled per
128-input block, fp32 sums), over the rows sorted by expert in 128-row tiles:

- XLA quantises x once per token and gathers x_q's rows (one byte an input) into the expert order; the tiles are
  laid out padded (`padded_layout`: each expert's rows start on a tile, tile_group[t] the expert of tile t or G
  past the last expert's tile, tile_start[t] the expert-order row of its first row), but x is not copied into that
  layout: a tile's TMA reads the 128 rows from tile_start[t] of the sorted x_q, the rows past its expert's (the next
  expert's, or zeros past the end) computed and never read back;
- `fp8.gpu_mosaic_grouped.grouped_call`: one CTA per SM loops over the (tile, column tile) items (`plgpu.nd_loop`, the
  column tile fastest: the items in flight share a tile's x and an expert's weights in L2); per item a warp-
  specialised pipeline: one warpgroup issues the TMA copies of the x tile, the weight tiles [block_n, 128] and the
  tile's activation scales of each K block, two compute warpgroups take 64 rows each: per K block a wgmma in a fresh
  accumulator, waited for, scaled by the rows' activation scales and the weight block's scale and added to the fp32
  accumulators in registers (one warpgroup's promotion overlaps the other's wgmma);
- gate/up kernel: two weights (gate and up, two accumulators), then SwiGLU in fp32 and h quantised in registers
  (the column tile is one 1 x 128 group of h), storing h_q [P, I] e4m3 in the padded layout and its scales
  transposed [I / 128, P];
- XLA folds each row's routing weight into h's scales (the down product is linear in them);
- down kernel: the same loop on h_q's tiles (aligned) and the expert's down tiles, storing [P, D] in x's dtype,
  whose rows XLA gathers back to the caller's order.

On the H200 at Ling-3.1-flash width (8192 tokens, 2026-12-03, `benchmarks/moe/w8a8.py`) the first form of these
kernels (one warpgroup a CTA, a CTA per (tile of 64 padded rows, column tile), x gathered into the padded layout)
ran at 0.76x the bf16 fused kernels (the Triton W8A8 ones, `gpu_triton.w8a8`, the default: 1.27x). Named variant
only: importing this module registers the entry point as MOSAIC ("gpu_mosaic") of `pallas_kernels.moe.ops`'
`w8a8_expert_rows`.

Shapes: 128 x 128 weight blocks, I and D multiples of 128. GPU only (the CPU lowers it for CUDA; the Mosaic GPU
interpreter does not run warp-specialised pipelines).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.fp8.gpu_mosaic import BLOCK_K, tma_store
from pallas_kernels.fp8.gpu_mosaic_grouped import ALIGN, BLOCK_M, grouped_call, store_rows
from pallas_kernels.fp8.reference import E4M3_MAX, EPS, quantize_activations
from pallas_kernels.moe import ops, tuned
from pallas_kernels.tuning import fill, lookup
from pallas_kernels.variants import Variant

MOSAIC = "gpu_mosaic"

TILE_KEYWORDS = (
    "gate_up_stages",
    "down_block_n",
    "down_stages",
    "down_columns",
    "gate_up_tma_store",
    "down_tma_store",
    "down_step_blocks",
)


def padded_layout(sizes_G, num_rows: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(pos_R, aligned_R, tile_group_T, tile_start_T) of the rows of the expert order (rows grouped by expert,
    sizes_G of them in turn, rows past their sum a tail):
    - pos_R: where row r lies in the padded layout, whose every expert starts on a BLOCK_M-row tile (the tail
      rows' pos is P = T * BLOCK_M, out of range);
    - aligned_R: where it lies in the aligned layout, whose every expert starts on a row that is a multiple of
      ALIGN (the tail rows' is past every expert's rows; sum(ceil(sizes / ALIGN)) * ALIGN rows);
    - tile_group_T: the expert of each of the T tiles (G past the last expert's);
    - tile_start_T: the aligned row of each tile's first row (0 past the last expert's tile).
    T = ceil(R / BLOCK_M) + min(G, R) covers any sizes."""
    num_groups = sizes_G.shape[0]
    num_tiles = -(-num_rows // BLOCK_M) + min(num_groups, num_rows)
    sizes_G = sizes_G.astype(jnp.int32)
    tiles_G = -(-sizes_G // BLOCK_M)
    tile_end_G = jnp.cumsum(tiles_G)
    tile_group_T = jnp.searchsorted(tile_end_G, jnp.arange(num_tiles), side="right").astype(jnp.int32)
    row_end_G = jnp.cumsum(sizes_G)
    aligned_sizes_G = -(-sizes_G // ALIGN) * ALIGN
    aligned_end_G = jnp.cumsum(aligned_sizes_G)
    rows_R = jnp.arange(num_rows, dtype=jnp.int32)
    group_R = jnp.searchsorted(row_end_G, rows_R, side="right")
    # per group and one past the last (the tail rows' group G): where its rows start in each layout
    row_start_g = jnp.append(row_end_G - sizes_G, row_end_G[-1])
    tile_row_g = jnp.append(tile_end_G - tiles_G, num_tiles) * BLOCK_M
    aligned_start_g = jnp.append(aligned_end_G - aligned_sizes_G, aligned_end_G[-1])
    within_R = rows_R - row_start_g[group_R]
    tile_start_R = tile_row_g[group_R]
    aligned_R = aligned_start_g[group_R]
    tile_start_T = (
        aligned_start_g[tile_group_T] + jnp.arange(num_tiles, dtype=jnp.int32) * BLOCK_M - tile_row_g[tile_group_T]
    )
    real_T = tile_group_T < num_groups
    return (
        jnp.where(group_R < num_groups, tile_start_R + within_R, num_tiles * BLOCK_M).astype(jnp.int32),
        (aligned_R + within_R).astype(jnp.int32),
        tile_group_T,
        jnp.where(real_T, tile_start_T, 0).astype(jnp.int32),
    )


def _swiglu(gate_MN, up_MN, limit: float | None):
    """`moe.reference.swiglu` in the ops a register tile has (SiLU as g / (1 + exp(-g)))."""
    activated_MN = gate_MN / (1.0 + jnp.exp(-gate_MN))
    if limit is None:
        return activated_MN * up_MN
    return jnp.minimum(activated_MN, limit) * jnp.clip(up_MN, -limit, limit)


def _store_h_quantized(accs, rows, cols, out_smem, h_q_gmem, h_scale_gmem, *, limit):
    """h quantised in registers: the column tile (128 wide, one sub-tile a weight) is one 1 x 128 group
    (`fp8.reference.quantize_groups`), its scales stored transposed ([I / 128, P]: a warpgroup's are 64 of one row),
    as the down kernel reads them; h_q through the warpgroup's shared-memory buffer by TMA where there is one, else
    from registers."""
    ((gate_MN,), (up_MN,)) = accs
    h_MN = _swiglu(gate_MN, up_MN, limit)
    scale_M = jnp.maximum(jnp.max(jnp.abs(h_MN), axis=1), EPS) / E4M3_MAX
    h_q_MN = jnp.clip(h_MN / lax.broadcast_in_dim(scale_M, h_MN.shape, [0]), -E4M3_MAX, E4M3_MAX)
    if out_smem is None:
        h_q_gmem[rows, cols] = h_q_MN.astype(h_q_gmem.dtype)
    else:
        tma_store((h_q_MN,), (out_smem.at[0],), (h_q_gmem.at[rows, cols],))
    h_scale_gmem[cols.start // BLOCK_K, rows] = scale_M


def takes(gate, up, down, down_block_n: int = BLOCK_K) -> bool:
    """Whether the kernels run these block-FP8 experts: 128 x 128 blocks, I and D multiples of 128, D of down's
    column tile (which divides 128 or is a multiple of it)."""
    width, hidden = gate.values.shape[1:]
    return (
        all(tuple(w.block) == (BLOCK_K, BLOCK_K) for w in (gate, up, down))
        and not width % BLOCK_K
        and not hidden % BLOCK_K
        and not hidden % down_block_n
        and not (BLOCK_K % down_block_n and down_block_n % BLOCK_K)
    )


def _check(gate, up, down, down_block_n: int) -> None:
    if not takes(gate, up, down, down_block_n):
        raise ValueError(
            "w8a8_expert_rows_mgpu takes 128 x 128 weight blocks and an expert width and hidden size that are "
            f"multiples of 128 (down's column tile {down_block_n} dividing 128 or a multiple of it, and D); got blocks "
            f"{[tuple(w.block) for w in (gate, up, down)]}, gate {gate.values.shape}, down {down.values.shape}"
        )


@functools.partial(jax.jit, static_argnames=("limit", *TILE_KEYWORDS, "fill_tail"))
def w8a8_expert_rows_mgpu(
    x_XD,
    source_R,
    order_R,
    row_weight_R,
    sizes_E,
    gate,
    up,
    down,
    limit: float | None,
    *,
    gate_up_stages: int | None = None,
    down_block_n: int | None = None,
    down_stages: int | None = None,
    down_columns: int | None = None,
    gate_up_tma_store: bool | None = None,
    down_tma_store: bool | None = None,
    down_step_blocks: int | None = None,
    fill_tail: bool = True,
    interpret: bool = False,
) -> jax.Array:
    """[R, D] in x's dtype, as `gpu_triton.w8a8.w8a8_expert_rows`: row order[r] = row_weight[r] *
    FFN_g(x[source[r]]) for the r-th row of the expert order (rows past sum(sizes) zeros), from block-FP8 gate, up
    [G, I, D] and down [G, D, I] (module docstring). fill_tail is the Triton kernels' (the tail rows are always
    zeros here); interpret is refused (GPU only). Tiles: None from `tuned.W8A8_MOSAIC_EXPERTS`."""
    del fill_tail
    if interpret:
        raise ValueError("w8a8_expert_rows_mgpu runs on a GPU only (the Mosaic GPU interpreter lacks its pipeline)")
    gate_up_stages, down_block_n, down_stages, down_columns, gate_up_tma_store, down_tma_store, down_step_blocks = fill(
        (gate_up_stages, down_block_n, down_stages, down_columns, gate_up_tma_store, down_tma_store, down_step_blocks),
        lookup(tuned.W8A8_MOSAIC_EXPERTS, dtype=x_XD.dtype),
    )
    _check(gate, up, down, down_block_n)
    num_rows = source_R.shape[0]
    pos_R, aligned_R, tile_group_T, tile_start_T = padded_layout(sizes_E, num_rows)
    num_tiles = tile_group_T.shape[0]
    padded_rows = num_tiles * BLOCK_M
    # x's rows in the aligned layout and BLOCK_M more (a tile's TMA reads 128 rows from its start); the scales'
    # rows 16-byte aligned
    aligned_rows = num_rows + min(sizes_E.shape[0], num_rows) * (ALIGN - 1) + BLOCK_M
    aligned_rows += -aligned_rows % 4
    token_S = jnp.zeros(aligned_rows, jnp.int32).at[aligned_R].set(source_R.astype(jnp.int32))
    x_q_XD, x_scale_XG = quantize_activations(x_XD, BLOCK_K)
    h_q_PI, h_scale_GP = grouped_call(
        tile_group_T,
        tile_start_T,
        x_q_XD[token_S],
        x_scale_XG[token_S].T,
        (gate, up),
        out_type=(
            jax.ShapeDtypeStruct((padded_rows, gate.values.shape[1]), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((gate.values.shape[1] // BLOCK_K, padded_rows), jnp.float32),
        ),
        block_n=BLOCK_K,
        columns=1,
        stages=gate_up_stages,
        store=functools.partial(_store_h_quantized, limit=limit),
        name="w8a8_gate_up_mgpu",
        tma_dtype=jnp.float8_e4m3fn if gate_up_tma_store else None,
    )
    row_weight_P = jnp.zeros(padded_rows, jnp.float32).at[pos_R].set(row_weight_R.astype(jnp.float32), mode="drop")
    y_PD = grouped_call(
        tile_group_T,
        jnp.arange(num_tiles, dtype=jnp.int32) * BLOCK_M,
        h_q_PI,
        h_scale_GP * row_weight_P,
        (down,),
        out_type=jax.ShapeDtypeStruct((padded_rows, down.values.shape[1]), x_XD.dtype),
        block_n=down_block_n,
        columns=math.gcd(down_columns, down.values.shape[1] // down_block_n),
        stages=down_stages,
        store=store_rows,
        name="w8a8_down_mgpu",
        tma_dtype=x_XD.dtype if down_tma_store else None,
        step_blocks=math.gcd(down_step_blocks, gate.values.shape[1] // BLOCK_K),
    )
    pos_of_out_R = jnp.zeros(num_rows, jnp.int32).at[order_R].set(pos_R)
    return jnp.take(y_PD, pos_of_out_R, axis=0, mode="fill", fill_value=0)


ops.VARIANTS["w8a8_expert_rows"][MOSAIC] = Variant("gpu", w8a8_expert_rows_mgpu)
