"""Grouped matmul on GPU: a Pallas kernel (Triton lowering) over row tiles that never cross a group.

The rows are cut into tiles of block_m group by group (a group's last tile is partial), plus tiles over
the unused tail rows, with jnp before the call; nothing is padded, scattered or gathered, the tiles just
start at unaligned rows. Program (column tile, row tile) runs a K loop of dots of its rows, masked to its
group, against that group's weight into an fp32 accumulator and stores the rows it owns; a tail tile
stores zeros. Every output element has exactly one owner, so the parallel programs never race. The grid
is sized for the worst case (each non-empty group wasting one partial tile) and the programs past the
used tiles store nothing. The dots spent on partial tiles are what padding each group to block_m would
cost. Column tiles vary fastest so the programs sharing a row tile of lhs run together (L2 reuse), and
a group's tiles are adjacent so its weight is read from HBM about once.

The tiling (`row_tiles`, `call_over_row_tiles`, `output_tile`) and the K loop (`tile_products`) are shared with
the fused expert kernels (`fused.py`), which differ in how rows are loaded and what is stored.

The same kernel with rhs read as [G, K, N] gives d_lhs = d_out @ rhs[g]; `grouped_weight_grad_gpu` gives
d_rhs[g] = d_out[rows of g].T @ lhs[rows of g], one program per (K tile, N tile, group) walking the group's
rows, so training needs no ragged_dot (whose XLA GPU lowering materialises a masked lhs per group).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.moe import tuned
from pallas_kernels.moe.gpu_triton.masked import mask_2d, masked_load
from pallas_kernels.moe.gpu_triton.weight_tiles import DENSE, ExpertTiles
from pallas_kernels.tuning import fill, lookup


def tile_products(
    load_lhs,
    rhs_refs,
    group,
    col0,
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    cols_ok_N,
    mask_k: bool,
    rhs_transposed: bool = False,
    weight_left: bool = False,
):
    """One fp32 [block_m, block_n] accumulator per weight in rhs_refs: the sum over K tiles of lhs tile @ rhs[group]
    tile, rhs [G, N, K] (or a dense [G, K, N] with rhs_transposed). A weight is a dense ref or an `ExpertTiles`
    (a quantised weight's refs, its tiles dequantised on chip to lhs's dtype). load_lhs(k0, k_ok_K) gives the lhs
    tile [block_m, block_k] (zeros outside the valid rows and K). A tail tile (group == G) runs no K steps: zeros.
    weight_left: the products as weight tile @ lhs tile^T into [block_n, block_m] accumulators, transposed at the
    end (a dequantised weight tile then stays in registers as the MMA's first operand, which Hopper's wgmma
    allows; its second must come from shared memory)."""
    weights = [w if isinstance(w, ExpertTiles) else ExpertTiles(DENSE, (w,)) for w in rhs_refs]
    num_groups, n_or_k, k_or_n = weights[0].shape
    k_dim = n_or_k if rhs_transposed else k_or_n

    def rhs_product(lhs_MK, weight, k0, k_ok_K):
        allow_tf32 = lhs_MK.dtype != jnp.float32
        if rhs_transposed:
            rhs_KN = masked_load(
                weight.refs[0].at[group, pl.ds(k0, block_k), pl.ds(col0, block_n)], mask_2d(k_ok_K, cols_ok_N)
            )
            return plgpu.dot(lhs_MK, rhs_KN, allow_tf32=allow_tf32)
        rhs_NK = weight.load(
            group, col0, k0, block_n=block_n, block_k=block_k, cols_ok_N=cols_ok_N, k_ok_K=k_ok_K, dtype=lhs_MK.dtype
        )
        if weight_left:
            return plgpu.dot(rhs_NK, lhs_MK, trans_b=True, allow_tf32=allow_tf32)
        return plgpu.dot(lhs_MK, rhs_NK, trans_b=True, allow_tf32=allow_tf32)

    def k_body(step, accs):
        k0 = step * block_k
        k_ok_K = k0 + jnp.arange(block_k) < k_dim if mask_k else None
        lhs_MK = load_lhs(k0, k_ok_K)
        return tuple(acc_MN + rhs_product(lhs_MK, weight, k0, k_ok_K) for acc_MN, weight in zip(accs, weights))

    # A clip, as Triton's lowering turns a jnp.where of two constants into i1.
    num_steps = jnp.clip(num_groups - group, 0, 1) * pl.cdiv(k_dim, block_k)
    acc_shape = (block_n, block_m) if weight_left else (block_m, block_n)
    accs = jax.lax.fori_loop(0, num_steps, k_body, tuple(jnp.zeros(acc_shape, jnp.float32) for _ in weights))
    return tuple(acc.T for acc in accs) if weight_left else accs


def output_tile(
    group_ref, row_start_ref, row_end_ref, n_dim: int, *, column_tile, block_m: int, block_n: int, mask_n: bool
):
    """(group, first row, first column, rows_ok_M, cols_ok_N or None) of this program's tile of the grid laid
    out by `call_over_row_tiles` (column_tile: its program id along the columns)."""
    row0, col0 = row_start_ref[...], column_tile * block_n
    rows_ok_M = row0 + jnp.arange(block_m) < row_end_ref[...]
    cols_ok_N = col0 + jnp.arange(block_n) < n_dim if mask_n else None
    return group_ref[...], row0, col0, rows_ok_M, cols_ok_N


def _kernel(
    group_ref,
    row_start_ref,
    row_end_ref,
    lhs_ref,
    rhs_ref,
    out_ref,
    *,
    column_tile,
    block_m: int,
    block_n: int,
    block_k: int,
    rhs_transposed: bool,
    mask_n: bool,
    mask_k: bool,
):
    group, row0, col0, rows_ok_M, cols_ok_N = output_tile(
        group_ref,
        row_start_ref,
        row_end_ref,
        out_ref.shape[1],
        column_tile=column_tile,
        block_m=block_m,
        block_n=block_n,
        mask_n=mask_n,
    )

    def load_lhs(k0, k_ok_K):
        return masked_load(lhs_ref.at[pl.ds(row0, block_m), pl.ds(k0, block_k)], mask_2d(rows_ok_M, k_ok_K))

    (acc_MN,) = tile_products(
        load_lhs,
        (rhs_ref,),
        group,
        col0,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        cols_ok_N=cols_ok_N,
        mask_k=mask_k,
        rhs_transposed=rhs_transposed,
    )
    plgpu.store(
        out_ref.at[pl.ds(row0, block_m), pl.ds(col0, block_n)],
        acc_MN.astype(out_ref.dtype),
        mask=mask_2d(rows_ok_M, cols_ok_N),
    )


def _weight_grad_kernel(
    offsets_ref, lhs_ref, d_out_ref, d_rhs_ref, *, block_m: int, block_n: int, block_k: int, mask_n: bool, mask_k: bool
):
    k_dim, n_dim = lhs_ref.shape[1], d_out_ref.shape[1]
    k0, col0, group = pl.program_id(0) * block_k, pl.program_id(1) * block_n, pl.program_id(2)
    start, end = offsets_ref[group], offsets_ref[group + 1]
    k_ok_K = k0 + jnp.arange(block_k) < k_dim if mask_k else None
    cols_ok_N = col0 + jnp.arange(block_n) < n_dim if mask_n else None

    def row_body(step, acc_NK):
        row0 = start + step * block_m
        rows_ok_M = row0 + jnp.arange(block_m) < end
        d_out_MN = masked_load(d_out_ref.at[pl.ds(row0, block_m), pl.ds(col0, block_n)], mask_2d(rows_ok_M, cols_ok_N))
        lhs_MK = masked_load(lhs_ref.at[pl.ds(row0, block_m), pl.ds(k0, block_k)], mask_2d(rows_ok_M, k_ok_K))
        return acc_NK + plgpu.dot(d_out_MN, lhs_MK, trans_a=True, allow_tf32=lhs_ref.dtype != jnp.float32)

    acc_NK = jax.lax.fori_loop(0, pl.cdiv(end - start, block_m), row_body, jnp.zeros((block_n, block_k), jnp.float32))
    plgpu.store(
        d_rhs_ref.at[group, pl.ds(col0, block_n), pl.ds(k0, block_k)],
        acc_NK.astype(d_rhs_ref.dtype),
        mask=mask_2d(cols_ok_N, k_ok_K),
    )


def max_row_tiles(num_rows: int, num_groups: int, block_m: int) -> int:
    """Most tiles the G groups plus the tail can need: p non-empty parts of s_i rows take
    sum(ceil(s_i / block_m)) <= p + (num_rows - p) // block_m tiles, largest at p = min(G + 1, num_rows)."""
    parts = min(num_groups + 1, num_rows)
    return parts + (num_rows - parts) // block_m


def row_tiles(group_sizes_G, num_rows: int, block_m: int, *, fill_tail: bool = True):
    """(group, first row, end row) of each row tile [T], int32, T = max_row_tiles; end - first <= block_m.

    Group G marks a tile of the unused tail (it stores zeros; with fill_tail False there are none and the
    tail's rows are never written); tiles past the used ones get empty row ranges. Group ends are clipped to
    num_rows, so an oversized group_sizes never reads past lhs.
    """
    num_groups = group_sizes_G.shape[0]
    group_ends_G = jnp.minimum(jnp.cumsum(group_sizes_G.astype(jnp.int32)), num_rows)
    tail_end = jnp.full((1,), num_rows, jnp.int32) if fill_tail else group_ends_G[-1:]
    ends_P = jnp.concatenate([group_ends_G, tail_end])  # parts: the groups, then the tail
    starts_P = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_P[:-1]])
    tiles_P = (ends_P - starts_P + block_m - 1) // block_m
    tile_ends_P = jnp.cumsum(tiles_P)
    tile_T = jnp.arange(max_row_tiles(num_rows, num_groups, block_m), dtype=jnp.int32)
    # compare_all: one parallel comparison; the default "scan" is a while loop, each step a GPU round trip
    part_T = jnp.searchsorted(tile_ends_P, tile_T, side="right", method="compare_all").astype(jnp.int32)
    used_T = part_T <= num_groups
    part_T = jnp.minimum(part_T, num_groups)
    row_start_T = starts_P[part_T] + (tile_T - tile_ends_P[part_T] + tiles_P[part_T]) * block_m
    row_end_T = jnp.minimum(ends_P[part_T], row_start_T + block_m)
    return part_T, jnp.where(used_T, row_start_T, 0), jnp.where(used_T, row_end_T, 0)


def _tile(size: int, wanted: int) -> int:
    """Triton tiles are powers of two, and its dots want at least 16 per side."""
    return max(16, min(wanted, pl.next_power_of_2(size)))


def row_tile_settings(
    dtype, given, *, num_rows: int, num_groups: int, n_dim: int, k_dim: int, table=tuned.GROUPED_MATMUL
) -> tuned.GroupedTiles:
    """The given (block_m, block_n, block_k, num_warps, num_stages), None ones from `table` (a `tuned` table of
    GroupedTiles) for dtype and the rows' bucket ("few_rows" when the groups average at most
    tuned.FEW_ROWS_PER_GROUP rows: decode); block sizes clipped to powers of two that fit the problem."""
    block_m, block_n, block_k, num_warps, num_stages = fill(
        given, lookup(table, dtype=dtype, bucket=tuned.rows_bucket(num_rows, num_groups))
    )
    return tuned.GroupedTiles(
        _tile(num_rows, block_m), _tile(n_dim, block_n), _tile(k_dim, block_k), num_warps, num_stages
    )


# The smallest row tile a group's last, partial tile shrinks to (see `call_over_row_tiles`).
MIN_ROW_TILE = 32


def row_tile_sizes(block_m: int, min_block_m: int | None = None) -> tuple[int, ...]:
    """The row-tile sizes a launch compiles: powers of two from min_block_m (default MIN_ROW_TILE, at least 16:
    Triton's dot) up to block_m."""
    size = min(block_m, max(16, MIN_ROW_TILE if min_block_m is None else min_block_m))
    sizes = []
    while size < block_m:
        sizes.append(size)
        size *= 2
    return (*sizes, block_m)


def _by_row_count(kernel, sizes):
    """kernel(..., block_m=size, column_tile=) for the smallest size of `sizes` that holds the tile's rows: a
    group's last tile (about half a tile wasted on average otherwise, at ~128 rows per group) runs only the dots
    it needs. The program id is read here, outside the branches (Pallas's interpret mode needs that)."""

    def sized(group_ref, row_start_ref, row_end_ref, *refs):
        run = functools.partial(kernel, group_ref, row_start_ref, row_end_ref, *refs, column_tile=pl.program_id(0))
        if len(sizes) == 1:
            return run(block_m=sizes[0])
        rows = row_end_ref[...] - row_start_ref[...]
        index = sum(jnp.clip(rows - size, 0, 1) for size in sizes[:-1])  # a clip: see tile_products
        return jax.lax.switch(index, [functools.partial(run, block_m=size) for size in sizes])

    return sized


def call_over_row_tiles(
    kernel,
    group_sizes_G,
    operands,
    out_shape,
    tiles: tuned.GroupedTiles,
    *,
    num_rows: int,
    n_dim: int,
    k_dim: int,
    interpret: bool,
    name: str,
    min_block_m: int | None = None,
    fill_tail: bool = True,
):
    """pallas_call of kernel(group_ref, row_start_ref, row_end_ref, *operand_refs, out_ref, column_tile=, block_m=,
    block_n=, block_k=, mask_n=, mask_k=) over the grid (column tile of n_dim, row tile of `row_tiles`): the row
    tiles of num_rows rows sorted by group, the operands and the output whole. A tile of fewer rows runs the
    kernel at the smallest of `row_tile_sizes(tiles.block_m, min_block_m)` that holds them; out_shape may be a
    tuple of outputs (the kernel then takes their refs in order). fill_tail False:
    the output's rows past sum(group_sizes) are left unwritten (undefined)."""
    group_T, row_start_T, row_end_T = row_tiles(group_sizes_G, num_rows, tiles.block_m, fill_tail=fill_tail)
    kernel = _by_row_count(
        functools.partial(
            kernel,
            block_n=tiles.block_n,
            block_k=tiles.block_k,
            mask_n=n_dim % tiles.block_n != 0,
            mask_k=k_dim % tiles.block_k != 0,
        ),
        row_tile_sizes(tiles.block_m, min_block_m),
    )
    whole = lambda shape: pl.BlockSpec(shape, lambda n, t: (0,) * len(shape))  # noqa: E731
    per_row_tile = pl.BlockSpec((None,), lambda n, t: (t,))
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n_dim, tiles.block_n), group_T.shape[0]),
        in_specs=[per_row_tile, per_row_tile, per_row_tile, *(whole(op.shape) for op in operands)],
        out_specs=jax.tree.map(lambda out: whole(out.shape), out_shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name=name,
    )(group_T, row_start_T, row_end_T, *operands)


@functools.partial(
    jax.jit,
    static_argnames=(
        "rhs_transposed",
        "block_m",
        "block_n",
        "block_k",
        "num_warps",
        "num_stages",
        "min_block_m",
        "interpret",
    ),
)
def grouped_matmul_gpu(
    lhs_MK,
    rhs,
    group_sizes_G,
    *,
    rhs_transposed: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_block_m: int | None = None,
    interpret: bool = False,
):
    """out [M, N] in lhs's dtype (fp32 accumulation): out[rows of g] = lhs[rows of g] @ rhs[g].T for rhs
    [G, N, K], or lhs[rows of g] @ rhs[g] for rhs [G, K, N] with rhs_transposed (the gradient w.r.t. lhs).

    rhs is cast to lhs's dtype; bf16 products use the tensor cores, fp32 ones stay IEEE fp32 (no tf32).
    Tile sizes and launch settings: None from `tuned.GROUPED_MATMUL` for lhs's dtype and the rows' bucket; tiles
    are powers of two. A group's last, partial
    row tile runs at the smallest power of two >= min_block_m (default MIN_ROW_TILE) that holds its rows.
    """
    num_rows, k_dim = lhs_MK.shape
    n_dim = rhs.shape[2] if rhs_transposed else rhs.shape[1]
    if num_rows == 0:
        return jnp.zeros((0, n_dim), lhs_MK.dtype)
    tiles = row_tile_settings(
        lhs_MK.dtype,
        (block_m, block_n, block_k, num_warps, num_stages),
        num_rows=num_rows,
        num_groups=group_sizes_G.shape[0],
        n_dim=n_dim,
        k_dim=k_dim,
    )
    out_shape = jax.ShapeDtypeStruct((num_rows, n_dim), lhs_MK.dtype)
    return call_over_row_tiles(
        functools.partial(_kernel, rhs_transposed=rhs_transposed),
        group_sizes_G,
        (lhs_MK, rhs.astype(lhs_MK.dtype)),
        out_shape,
        tiles,
        num_rows=num_rows,
        n_dim=n_dim,
        k_dim=k_dim,
        interpret=interpret,
        name="grouped_matmul",
        min_block_m=min_block_m,
    )


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_warps", "num_stages", "interpret"))
def grouped_weight_grad_gpu(
    lhs_MK,
    d_out_MN,
    group_sizes_G,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
):
    """d_rhs [G, N, K] in lhs's dtype (fp32 accumulation): d_rhs[g] = d_out[rows of g].T @ lhs[rows of g].

    An empty group gets zeros. d_out is cast to lhs's dtype; tiles: None from `tuned.WEIGHT_GRAD`.
    """
    num_rows, k_dim = lhs_MK.shape
    n_dim = d_out_MN.shape[1]
    num_groups = group_sizes_G.shape[0]
    if num_rows == 0:
        return jnp.zeros((num_groups, n_dim, k_dim), lhs_MK.dtype)
    block_m, block_n, block_k, num_warps, num_stages = fill(
        (block_m, block_n, block_k, num_warps, num_stages), lookup(tuned.WEIGHT_GRAD, dtype=lhs_MK.dtype)
    )
    block_m, block_n, block_k = _tile(num_rows, block_m), _tile(n_dim, block_n), _tile(k_dim, block_k)
    offsets = jnp.concatenate(
        [jnp.zeros((1,), jnp.int32), jnp.minimum(jnp.cumsum(group_sizes_G.astype(jnp.int32)), num_rows)]
    )
    kernel = functools.partial(
        _weight_grad_kernel,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        mask_n=n_dim % block_n != 0,
        mask_k=k_dim % block_k != 0,
    )
    whole = lambda shape: pl.BlockSpec(shape, lambda k, n, g: (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(k_dim, block_k), pl.cdiv(n_dim, block_n), num_groups),
        in_specs=[whole((num_groups + 1,)), whole(lhs_MK.shape), whole(d_out_MN.shape)],
        out_specs=whole((num_groups, n_dim, k_dim)),
        out_shape=jax.ShapeDtypeStruct((num_groups, n_dim, k_dim), lhs_MK.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_weight_grad",
    )(offsets, lhs_MK, d_out_MN.astype(lhs_MK.dtype))
