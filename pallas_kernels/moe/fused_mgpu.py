"""The routed-expert FFN on Hopper as two Pallas **Mosaic GPU** kernels (TMA pipelines into wgmma), with the
signatures and semantics of the Triton ones in `pallas_kernels.moe.fused_gpu`:

- `gather_swiglu_mgpu`: h [R, I] = swiglu(x[source] @ gate[g].T, x[source] @ up[g].T, limit) in sorted order;
- `down_scatter_mgpu`: y[dest[r]] = row_weight[r] * (h[r] @ down[g].T), weighted in fp32.

Design (every choice a keyword argument, so that `scripts/bench_moe.py` can sweep it):

- Row tiles are `gmm_gpu.row_tiles` (tiles never cross a group, an empty group has none, a tail tile over
  the unused rows stores zeros), computed by XLA before the call and read by each CTA as three scalars.
  Each tile computes block_m rows and stores only its own n <= block_m: the waste is what padding each group
  to block_m would cost, so block_m = 64 (one wgmma row block) wastes half of what 128 does at ~128 rows per
  expert. The lhs is read in a tiled row order (tile t's rows at [t * block_m, +block_m), one XLA gather
  per kernel): Mosaic GPU's TMA loads into the swizzled SMEM tiles wgmma reads need row offsets that are
  multiples of 8, which the tiles' first rows in sorted order are not.
- A plain grid, one CTA per (column tile, row tile), column tiles fastest: the CTAs sharing a row tile, and
  then a group's next row tile, run together, so each expert's weights come from HBM about once and are
  re-read from L2. Not persistent: the hardware scheduler balances the uneven work (a tile is either full,
  partial or empty), an empty trailing tile exits at once, and a second resident CTA (when two fit in shared
  memory) overlaps its main loop with the first's epilogue, which a persistent loop over `emit_pipeline`
  would not do without hand-written cross-tile prefetching.
- One warpgroup per CTA runs `plgpu.emit_pipeline` over K with `max_concurrent_steps` stages of TMA loads;
  the weights are [G, N, K], so the rhs tile is [block_n, block_k] in SMEM, fed to wgmma transposed.
  `gather_swiglu` keeps two fp32 accumulators (gate, up: 2 x block_m x block_n registers) and applies the
  SwiGLU on them in fp32 before rounding h to x's dtype.
- Gather: Hopper's TMA cannot gather rows, so `gather_swiglu_mgpu` materialises x[source] in the tiled row
  order with one XLA gather (T x block_m x D: ~800 MB at 8192 tokens x top-8 x 4096 with 64-row tiles, about
  0.2 ms of HBM writes); `down_scatter_mgpu` likewise copies h (~200 MB) and the row weights.
- Scatter: `scatter="rows"` (default) stores each owned row of the weighted tile with its own one-row TMA
  copy to row dest[r] (no extra pass over y; the copies run while other resident CTAs compute); the
  alternative `scatter="sorted"` stores the tile's rows contiguously in sorted order and unsorts y with one
  XLA gather afterwards (another R x D read and write, ~0.25 ms at full size), kept for the benchmark.
- Variable row counts are stored with static-shape TMA copies: n is split into its binary digits, one copy
  of 2^i rows per set digit (under `pl.when`), all from an unswizzled SMEM staging tile.

bf16 and fp16 only: wgmma multiplies fp32 operands as tf32, which would not match the Triton kernels' IEEE
fp32 (use `fused_gpu` for fp32). D and I must be multiples of the column and K tiles. Lowering for CUDA
needs jax >= 0.11.2 (0.10.2's layout inference rejects down_scatter's row-weight broadcast); the Mosaic GPU
interpreter runs both kernels on jax 0.10.2 too.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.compat import mosaic_gpu_interpret
from pallas_kernels.moe.gmm_gpu import row_tiles
from pallas_kernels.moe.reference import swiglu

_DTYPES = (jnp.bfloat16, jnp.float16)
_SCATTERS = ("rows", "sorted")
_INTERPRETER_TRANSPOSES = jax.__version_info__ >= (0, 11, 2)


class MgpuTiles(NamedTuple):
    """block_m: rows per CTA (64 or 128: one or two wgmma row blocks of the one warpgroup); block_n, block_k:
    the output column tile and the K step; max_concurrent_steps: TMA pipeline stages in flight."""
    block_m: int
    block_n: int
    block_k: int
    max_concurrent_steps: int


# Defaults before any GPU measurement: 64-row tiles (less waste at ~128 rows per expert), 128-byte K rows
# (block_k 64 in bf16, the widest swizzle); gather_swiglu's two accumulators get half of down's columns.
# SMEM per CTA: gather_swiglu 4 x (8 + 16 + 16) KiB + 16 KiB, down_scatter 4 x (8 + 32) KiB + 32 KiB.
GATHER_SWIGLU_MGPU_TILES = MgpuTiles(64, 128, 64, 4)
DOWN_SCATTER_MGPU_TILES = MgpuTiles(64, 256, 64, 4)
_TILE_ARGS = ("block_m", "block_n", "block_k", "max_concurrent_steps", "interpret")


def _settings(defaults: MgpuTiles, given, *, n_dim: int, k_dim: int, dtype) -> MgpuTiles:
    """The given tiles, None entries from defaults; checks what the kernels assume."""
    tiles = MgpuTiles(*(value or default for value, default in zip(given, defaults)))
    if jnp.dtype(dtype) not in map(jnp.dtype, _DTYPES):
        raise NotImplementedError(f"Mosaic GPU expert kernels take bf16 or fp16, not {jnp.dtype(dtype).name}")
    if tiles.block_m not in (64, 128):
        raise ValueError(f"block_m must be 64 or 128 (wgmma row blocks), got {tiles.block_m}")
    if n_dim % tiles.block_n or k_dim % tiles.block_k:
        raise ValueError(f"N {n_dim} and K {k_dim} must be multiples of block_n {tiles.block_n} and "
                         f"block_k {tiles.block_k}")
    return tiles


class _Tile(NamedTuple):
    """This CTA's share: its row tile's index (its rows sit at [index * block_m, +block_m) of the tiled
    operands), group (G for the tail), first sorted row and row count (0: nothing to do), first column."""
    index: jax.Array
    group: jax.Array
    row_start: jax.Array
    num_rows: jax.Array
    col_start: jax.Array


def _this_tile(group_T, row_start_T, row_end_T, *, block_n: int) -> _Tile:
    index = jax.lax.axis_index("tile")
    row_start = row_start_T[index]
    return _Tile(index, group_T[index], row_start, row_end_T[index] - row_start,
                 jax.lax.axis_index("col") * block_n)


def _tile_products(lhs_PK, rhs_list, tile: _Tile, accs, tiles: MgpuTiles, *, rhs_kn: bool):
    """accs[i] += the tile's lhs rows [block_m, K] @ rhs_list[i][group] column tile.T over a TMA pipeline of
    K steps, rhs [G, N, K] (wgmma reads the SMEM tile transposed), or rhs [G, K, N] with rhs_kn; a tail tile
    (group == G) runs none, its accumulators stay zero."""
    num_groups, k_dim = rhs_list[0].shape[0], rhs_list[0].shape[1 if rhs_kn else 2]
    col_tile = tile.col_start // tiles.block_n

    def step(_, lhs_MK, *rhs_tiles):
        for acc, rhs_tile in zip(accs, rhs_tiles):
            plgpu.wgmma(acc, lhs_MK, rhs_tile if rhs_kn else rhs_tile.T)
        # the previous step's copies are done with once this step's products are the only ones in flight
        plgpu.wgmma_wait(len(accs))

    rhs_spec = (plgpu.BlockSpec((tiles.block_k, tiles.block_n), lambda k: (k, col_tile), delay_release=1) if rhs_kn
                else plgpu.BlockSpec((tiles.block_n, tiles.block_k), lambda k: (col_tile, k), delay_release=1))
    pipeline = plgpu.emit_pipeline(
        step, grid=(k_dim // tiles.block_k,),
        in_specs=[plgpu.BlockSpec((tiles.block_m, tiles.block_k), lambda k: (tile.index, k), delay_release=1),
                  *(rhs_spec for _ in rhs_list)],
        max_concurrent_steps=max(2, tiles.max_concurrent_steps))

    @pl.when(tile.group < num_groups)
    def _():
        pipeline(lhs_PK, *(rhs.at[tile.group] for rhs in rhs_list))


def _binary_digits(limit: int):
    """The powers of two from the largest <= limit down to 1."""
    size = 1 << (limit.bit_length() - 1)
    while size:
        yield size
        size //= 2


def _store_contiguous_rows(tile_smem_MN, out_ref, tile: _Tile, *, block_m: int):
    """The tile's first n rows to out_ref rows [row_start, row_start + n): one static-shape TMA copy per set
    binary digit of n."""
    stored = 0
    for size in _binary_digits(block_m):
        take = tile.num_rows & size
        pl.when(take != 0)(functools.partial(plgpu.copy_smem_to_gmem, tile_smem_MN.at[pl.ds(stored, size)],
                                             out_ref.at[pl.ds(tile.row_start + stored, size)]))
        stored += take


def _scatter_rows(tile_smem_MN, out_ref, dest_R, tile: _Tile, *, block_m: int):
    """The tile's row i to out_ref row dest[row_start + i], for i < n: one-row TMA copies."""
    last_row = dest_R.shape[0] - 1
    for i in range(block_m):
        dest = dest_R[jnp.minimum(tile.row_start + i, last_row)]
        pl.when(i < tile.num_rows)(functools.partial(plgpu.copy_smem_to_gmem, tile_smem_MN.at[pl.ds(i, 1)],
                                                     out_ref.at[pl.ds(dest, 1)]))


def _epilogue(out_MN, out_ref, store):
    """out_MN (registers) to an unswizzled SMEM tile, then `store(tile_smem, out_ref)`; waits for the copies
    to finish reading SMEM before the CTA's shared memory goes."""
    def scope(tile_smem_MN):
        tile_smem_MN[...] = out_MN
        plgpu.commit_smem()
        store(tile_smem_MN, out_ref)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(scope, plgpu.SMEM(out_MN.shape, out_MN.dtype))


def _gather_swiglu_kernel(group_T, row_start_T, row_end_T, x_PD, gate, up, h_RI, *, limit, tiles: MgpuTiles,
                          rhs_kn: bool):
    tile = _this_tile(group_T, row_start_T, row_end_T, block_n=tiles.block_n)

    @pl.when(tile.num_rows > 0)
    def _():
        def products(gate_acc, up_acc):
            _tile_products(x_PD, (gate, up), tile, (gate_acc, up_acc), tiles, rhs_kn=rhs_kn)
            return swiglu(gate_acc[...], up_acc[...], limit).astype(h_RI.dtype)

        acc = plgpu.ACC((tiles.block_m, tiles.block_n), jnp.float32)
        h_MN = pl.run_scoped(products, acc, acc)
        _epilogue(h_MN, h_RI.at[:, pl.ds(tile.col_start, tiles.block_n)],
                  functools.partial(_store_contiguous_rows, tile=tile, block_m=tiles.block_m))


def _down_scatter_kernel(group_T, row_start_T, row_end_T, dest_R, row_weight_P, h_PI, down, y_RD, *,
                         scatter: str, tiles: MgpuTiles, rhs_kn: bool):
    tile = _this_tile(group_T, row_start_T, row_end_T, block_n=tiles.block_n)

    @pl.when(tile.num_rows > 0)
    def _():
        def products(acc):
            _tile_products(h_PI, (down,), tile, (acc,), tiles, rhs_kn=rhs_kn)
            return acc[...]

        acc_MN = pl.run_scoped(products, plgpu.ACC((tiles.block_m, tiles.block_n), jnp.float32))
        weight_M = _tile_row_weights(row_weight_P, tile, block_m=tiles.block_m)
        y_MN = (acc_MN * weight_M[:, None]).astype(y_RD.dtype)
        store = (functools.partial(_scatter_rows, dest_R=dest_R, tile=tile, block_m=tiles.block_m)
                 if scatter == "rows" else
                 functools.partial(_store_contiguous_rows, tile=tile, block_m=tiles.block_m))
        _epilogue(y_MN, y_RD.at[:, pl.ds(tile.col_start, tiles.block_n)], store)


def _tile_row_weights(row_weight_P, tile: _Tile, *, block_m: int):
    """The tile's row weights [block_m] fp32, through a TMA copy into SMEM, in the accumulator's row layout."""
    def scope(weight_smem_M, barrier):
        plgpu.copy_gmem_to_smem(row_weight_P.at[pl.ds(tile.index * block_m, block_m)], weight_smem_M, barrier)
        plgpu.barrier_wait(barrier)
        return weight_smem_M[...]

    return pl.run_scoped(scope, plgpu.SMEM((block_m,), jnp.float32), plgpu.Barrier())


class _RowTiles(NamedTuple):
    """`gmm_gpu.row_tiles` (group, first row, end row per tile [T]) and the tiled row order row_P [T * block_m]:
    tile t's rows sit at [t * block_m, +block_m), row t * block_m + i holding sorted row row_start[t] + i
    (clipped into [0, R): a row past the tile's end is computed but never stored). TMA loads need tile starts
    at multiples of the SMEM tiling (8 rows), which sorted rows do not have: the tiled copies of the kernels'
    lhs (one XLA gather each) give them that, and wasting no more rows than the tiles already do."""
    group_T: jax.Array
    row_start_T: jax.Array
    row_end_T: jax.Array
    row_P: jax.Array


def _row_tiles(group_sizes_G, num_rows: int, block_m: int) -> _RowTiles:
    group_T, row_start_T, row_end_T = row_tiles(group_sizes_G, num_rows, block_m)
    row_TM = row_start_T[:, None] + jnp.arange(block_m, dtype=jnp.int32)
    return _RowTiles(group_T, row_start_T, row_end_T, jnp.minimum(row_TM, num_rows - 1).reshape(-1))


def _call(kernel, row_tiles_: _RowTiles, operands, num_rows: int, n_dim: int, dtype, tiles: MgpuTiles, *,
          interpret: bool, name: str):
    """plgpu.kernel of kernel(group_T, row_start_T, row_end_T, *operands, out [num_rows, n_dim]) over the grid
    (column tile, row tile)."""
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((num_rows, n_dim), dtype),
        grid=(n_dim // tiles.block_n, row_tiles_.group_T.shape[0]),
        grid_names=("col", "tile"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=mosaic_gpu_interpret(interpret),
        kernel_name=name,
    )
    return call(row_tiles_.group_T, row_tiles_.row_start_T, row_tiles_.row_end_T, *operands)


def _weights_for_kernel(w_GNK, dtype, interpret: bool):
    """(weights as the kernel reads them, rhs_kn): [G, N, K] in dtype, or [G, K, N] under the interpreter of
    jax < 0.11.2, which cannot wgmma a transposed SMEM tile (everything else in the kernel is the same)."""
    w_GNK = w_GNK.astype(dtype)
    if interpret and not _INTERPRETER_TRANSPOSES:
        return jnp.swapaxes(w_GNK, 1, 2), True
    return w_GNK, False


@functools.partial(jax.jit, static_argnames=("limit", *_TILE_ARGS))
def gather_swiglu_mgpu(x_XD, source_R, group_sizes_G, gate_GID, up_GID, *, limit: float | None,
                       block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                       max_concurrent_steps: int | None = None, interpret: bool = False):
    """h [R, I] in x's dtype (bf16 / fp16): h[r] = swiglu(x[source[r]] @ gate[g].T, x[source[r]] @ up[g].T,
    limit) for the rows r of group g (rows sorted by group, group_sizes [G], sum <= R), gate and up fp32 until
    the SwiGLU; rows past the sum get zeros. source [R] indexes x's rows; gate and up [G, I, D] are cast to x's
    dtype. Tiles default to GATHER_SWIGLU_MGPU_TILES."""
    num_rows, (width, hidden) = source_R.shape[0], gate_GID.shape[1:]
    tiles = _settings(GATHER_SWIGLU_MGPU_TILES, (block_m, block_n, block_k, max_concurrent_steps),
                      n_dim=width, k_dim=hidden, dtype=x_XD.dtype)
    if num_rows == 0:
        return jnp.zeros((0, width), x_XD.dtype)
    tiled = _row_tiles(group_sizes_G, num_rows, tiles.block_m)
    x_PD = x_XD[source_R.astype(jnp.int32)[tiled.row_P]]
    (gate, rhs_kn), (up, _) = (_weights_for_kernel(w, x_XD.dtype, interpret) for w in (gate_GID, up_GID))
    kernel = functools.partial(_gather_swiglu_kernel, limit=limit, tiles=tiles, rhs_kn=rhs_kn)
    return _call(kernel, tiled, (x_PD, gate, up), num_rows, width, x_XD.dtype, tiles, interpret=interpret,
                 name="gather_swiglu_mgpu")


@functools.partial(jax.jit, static_argnames=("scatter", *_TILE_ARGS))
def down_scatter_mgpu(h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI, *, scatter: str = "rows",
                      block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                      max_concurrent_steps: int | None = None, interpret: bool = False):
    """y [R, D] in h's dtype (bf16 / fp16): y[dest[r]] = row_weight[r] * (h[r] @ down[g].T) for the rows r of
    group g (rows sorted by group, group_sizes [G], sum <= R), accumulated and weighted in fp32; rows past the
    sum store zeros. dest [R] int32 must be a permutation of [0, R); row_weight [R] fp32. down [G, D, I] is
    cast to h's dtype. scatter: "rows" (one-row TMA stores to dest in the kernel) or "sorted" (the kernel
    stores sorted rows, one XLA gather unsorts them). Tiles default to DOWN_SCATTER_MGPU_TILES."""
    if scatter not in _SCATTERS:
        raise ValueError(f"scatter must be one of {_SCATTERS}, got {scatter!r}")
    num_rows, (hidden, width) = h_RI.shape[0], down_GDI.shape[1:]
    tiles = _settings(DOWN_SCATTER_MGPU_TILES, (block_m, block_n, block_k, max_concurrent_steps),
                      n_dim=hidden, k_dim=width, dtype=h_RI.dtype)
    if num_rows == 0:
        return jnp.zeros((0, hidden), h_RI.dtype)
    dest_R = dest_R.astype(jnp.int32)
    tiled = _row_tiles(group_sizes_G, num_rows, tiles.block_m)
    down, rhs_kn = _weights_for_kernel(down_GDI, h_RI.dtype, interpret)
    operands = (dest_R, row_weight_R.astype(jnp.float32)[tiled.row_P], h_RI[tiled.row_P], down)
    kernel = functools.partial(_down_scatter_kernel, scatter=scatter, tiles=tiles, rhs_kn=rhs_kn)
    y_RD = _call(kernel, tiled, operands, num_rows, hidden, h_RI.dtype, tiles, interpret=interpret,
                 name="down_scatter_mgpu")
    if scatter == "sorted":
        return y_RD[jnp.zeros((num_rows,), jnp.int32).at[dest_R].set(jnp.arange(num_rows, dtype=jnp.int32))]
    return y_RD
