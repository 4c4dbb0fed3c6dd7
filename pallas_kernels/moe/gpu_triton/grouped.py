"""The skeleton of the MoE grouped kernels on GPU (Pallas, Triton lowering), written once: the grouped matmul
(`gmm`), the fused expert kernels (`fused`) and their W8A8 forms (`w8a8`) are bodies run over it.

The rows, sorted by group, are cut into tiles of block_m group by group (a group's last tile is partial), plus
tiles over the unused tail rows, with jnp before the call (`row_tiles`); nothing is padded, the tiles just start
at unaligned rows. Program (column tile, row tile) runs a K loop of products of its rows, masked to its group,
against that group's weight into fp32 accumulators and stores the rows it owns; a tail tile stores zeros. Every
output element has exactly one owner, so the parallel programs never race. The grid is sized for the worst case
(each non-empty group wasting one partial tile) and the programs past the used tiles store nothing. Column tiles
vary fastest so the programs sharing a row tile run together (L2 reuse), and a group's tiles are adjacent so its
weight is read from HBM about once. A group's last tile runs at the smallest power of two that holds its rows
(`row_tile_sizes`), so it does only the products it needs.

`grouped_call` launches a body over that grid with the launch settings of `launch_settings` (a
`tuned.GroupedTiles`); the body gets its program's `Tile`, which holds the building blocks: the row loads
(`Tile.rows`, gathered through an index: `Tile.gathered`), the weight tiles (`Tile.weight_tile`), the K loop
(`Tile.accumulate`; with dense or quantised expert weights, dequantised on chip: `Tile.weight_products`) and the
stores (`Tile.store`, scattered and weighted per row: `Tile.scatter`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.moe import tuned
from pallas_kernels.moe.gpu_triton.weight_tiles import DENSE, ExpertTiles
from pallas_kernels.triton_masked import mask_2d, masked_load
from pallas_kernels.tuning import fill, lookup

# The smallest row tile a group's last, partial tile shrinks to (`row_tile_sizes`).
MIN_ROW_TILE = 32


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


def row_tile_sizes(block_m: int, min_block_m: int | None = None) -> tuple[int, ...]:
    """The row-tile sizes a launch compiles: powers of two from min_block_m (default MIN_ROW_TILE, at least 16:
    Triton's dot) up to block_m."""
    size = min(block_m, max(16, MIN_ROW_TILE if min_block_m is None else min_block_m))
    sizes = []
    while size < block_m:
        sizes.append(size)
        size *= 2
    return (*sizes, block_m)


def fit_tile(size: int, wanted: int) -> int:
    """A tile of `wanted` clipped to the problem's `size`: Triton tiles are powers of two, and its dots want at
    least 16 per side."""
    return max(16, min(wanted, pl.next_power_of_2(size)))


def launch_settings(
    table, requested: tuple, *, dtype, num_rows: int, num_groups: int, n_dim: int, k_dim: int
) -> tuned.GroupedTiles:
    """The requested (block_m, block_n, block_k, num_warps, num_stages), None ones from `table` (a `tuned` table
    of GroupedTiles) for dtype and the rows' bucket (`tuned.rows_bucket`: "few_rows" when the groups average at
    most tuned.FEW_ROWS_PER_GROUP rows, decode); block sizes fitted to the problem (`fit_tile`)."""
    block_m, block_n, block_k, num_warps, num_stages = fill(
        requested, lookup(table, dtype=dtype, bucket=tuned.rows_bucket(num_rows, num_groups))
    )
    return tuned.GroupedTiles(
        fit_tile(num_rows, block_m), fit_tile(n_dim, block_n), fit_tile(k_dim, block_k), num_warps, num_stages
    )


@dataclasses.dataclass(frozen=True)
class TileShape:
    """A kernel's static tile: block_m rows (the weight gradient: rows a step), block_n of the n_dim output
    columns, K steps of block_k of k_dim, over num_groups groups."""

    block_m: int
    block_n: int
    block_k: int
    n_dim: int
    k_dim: int
    num_groups: int

    @property
    def mask_n(self) -> bool:
        """Whether the last column tile is partial (its columns need a mask)."""
        return self.n_dim % self.block_n != 0

    @property
    def mask_k(self) -> bool:
        """Whether the last K step is partial."""
        return self.k_dim % self.block_k != 0


def _columns(col0, block: int):
    return (col0 + jnp.arange(block))[None, :]


@dataclasses.dataclass(frozen=True)
class Tile:
    """A program's output tile of `grouped_call`'s grid: its group (num_groups on a tail tile), rows [row0,
    row0 + block_m) of which rows_ok_M are its own, columns [col0, col0 + block_n) of which cols_ok_N are inside
    the output (None: all), column_tile its program id along the columns."""

    shape: TileShape
    column_tile: jax.Array
    group: jax.Array
    row0: jax.Array
    col0: jax.Array
    rows_ok_M: jax.Array
    cols_ok_N: jax.Array | None

    @classmethod
    def of_program(cls, shape: TileShape, column_tile, group_ref, row_start_ref, row_end_ref) -> Tile:
        """The tile of program (column_tile, row tile), read from its row tile's group, start and end refs."""
        row0 = row_start_ref[...]
        rows_ok_M = row0 + jnp.arange(shape.block_m) < row_end_ref[...]
        return cls(shape, column_tile, group_ref[...], row0, None, rows_ok_M, None).at_column(column_tile)

    def at_column(self, column_tile) -> Tile:
        """The same rows at column tile `column_tile`."""
        col0 = column_tile * self.shape.block_n
        cols_ok_N = col0 + jnp.arange(self.shape.block_n) < self.shape.n_dim if self.shape.mask_n else None
        return dataclasses.replace(self, column_tile=column_tile, col0=col0, cols_ok_N=cols_ok_N)

    def rows(self, ref, k0, k_ok_K):
        """ref[row0 : row0 + block_m, k0 : k0 + block_k], zeros outside the tile's rows and k_ok_K."""
        block_MK = ref.at[pl.ds(self.row0, self.shape.block_m), pl.ds(k0, self.shape.block_k)]
        return masked_load(block_MK, mask_2d(self.rows_ok_M, k_ok_K))

    def row_indices(self, index_ref, fill: int):
        """index_ref[row0 : row0 + block_m] as int32 [block_m], `fill` (an index past the indexed array) on rows
        outside the tile: a masked store through it then writes nothing, in interpret mode too."""
        return plgpu.load(index_ref.at[pl.ds(self.row0, self.shape.block_m)], mask=self.rows_ok_M, other=fill)

    def gathered(self, ref, index_M1, k0, k_ok_K):
        """ref[index[m], k0 : k0 + block_k] for the tile's rows m (index_M1 [block_m, 1], from `row_indices`),
        zeros outside the tile's rows and k_ok_K."""
        return masked_load(ref.at[index_M1, _columns(k0, self.shape.block_k)], mask_2d(self.rows_ok_M, k_ok_K))

    def accumulate(self, step_products, count: int, *, transposed: bool = False):
        """`count` fp32 accumulators [block_m, block_n] ([block_n, block_m] transposed): the sums over the K steps
        of step_products(step, k0, k_ok_K), the step's products in order of the accumulators (k_ok_K None when
        no step is partial). A tail tile (group == num_groups) runs no K steps: zeros."""
        shape = self.shape

        def k_body(step, accs):
            k0 = step * shape.block_k
            k_ok_K = k0 + jnp.arange(shape.block_k) < shape.k_dim if shape.mask_k else None
            return tuple(acc + product for acc, product in zip(accs, step_products(step, k0, k_ok_K)))

        # A clip, as Triton's lowering turns a jnp.where of two constants into i1.
        num_steps = jnp.clip(shape.num_groups - self.group, 0, 1) * pl.cdiv(shape.k_dim, shape.block_k)
        acc_shape = (shape.block_n, shape.block_m) if transposed else (shape.block_m, shape.block_n)
        return jax.lax.fori_loop(0, num_steps, k_body, tuple(jnp.zeros(acc_shape, jnp.float32) for _ in range(count)))

    def walk_columns(self, columns: int, step_products, count: int, emit) -> None:
        """`accumulate` over up to `columns` column tiles from this one, as one loop of (column tile, K step), so
        that the loads run ahead across column tiles (a pipeline filled once a program, not once a column tile):
        step_products(tile, step, k0, k_ok_K) gives the step's products for `tile` (that column tile's Tile);
        emit(tile, accumulators) takes each column tile's sums after its last K step. A tail tile emits zeros."""
        if columns == 1:
            emit(self, self.accumulate(functools.partial(step_products, self), count))
            return
        shape = self.shape
        k_steps = pl.cdiv(shape.k_dim, shape.block_k)
        here = jnp.minimum(columns, pl.cdiv(shape.n_dim, shape.block_n) - self.column_tile)
        real = jnp.clip(shape.num_groups - self.group, 0, 1)  # a clip: see accumulate
        zeros = tuple(jnp.zeros((shape.block_m, shape.block_n), jnp.float32) for _ in range(count))

        def step_body(index, accs):
            step = jax.lax.rem(index, k_steps)  # lax's: jnp's % and // lower to Triton with an i1 operand
            tile = self.at_column(self.column_tile + jax.lax.div(index, k_steps))
            k0 = step * shape.block_k
            k_ok_K = k0 + jnp.arange(shape.block_k) < shape.k_dim if shape.mask_k else None
            accs = tuple(acc + product for acc, product in zip(accs, step_products(tile, step, k0, k_ok_K)))

            def flush():
                emit(tile, accs)
                return zeros

            return jax.lax.cond(step == k_steps - 1, flush, lambda: accs)

        jax.lax.fori_loop(0, real * here * k_steps, step_body, zeros)

        def tail_body(column, carry):
            emit(self.at_column(self.column_tile + column), zeros)
            return carry

        jax.lax.fori_loop(0, (1 - real) * here, tail_body, 0)

    def weight_tile(self, load, k0, k_ok_K, **options):
        """load(group, col0, k0, block_n=, block_k=, cols_ok_N=, k_ok_K=, **options): the [block_n, block_k] tile
        at (col0, k0) of the tile's group's weight, as a loader of `weight_tiles` reads it."""
        return load(
            self.group,
            self.col0,
            k0,
            block_n=self.shape.block_n,
            block_k=self.shape.block_k,
            cols_ok_N=self.cols_ok_N,
            k_ok_K=k_ok_K,
            **options,
        )

    def weight_products(self, load_lhs, weights, *, rhs_transposed: bool = False, weight_left: bool = False):
        """One fp32 [block_m, block_n] accumulator per weight: the sum over K steps of lhs tile @ weight[group]
        tile, the weight [G, N, K] (or a dense [G, K, N] with rhs_transposed). A weight is a dense ref or an
        `ExpertTiles` (a quantised weight's refs, its tiles dequantised on chip to lhs's dtype). load_lhs(k0,
        k_ok_K) gives the lhs tile [block_m, block_k] (zeros outside the valid rows and K). weight_left: the
        products as weight tile @ lhs tile^T into [block_n, block_m] accumulators, transposed at the end (a
        dequantised weight tile then stays in registers as the MMA's first operand, which Hopper's wgmma allows;
        its second must come from shared memory)."""
        weights = [w if isinstance(w, ExpertTiles) else ExpertTiles(DENSE, (w,)) for w in weights]
        block_n, block_k = self.shape.block_n, self.shape.block_k

        def product(lhs_MK, weight, k0, k_ok_K):
            allow_tf32 = lhs_MK.dtype != jnp.float32
            if rhs_transposed:
                rhs_KN = masked_load(
                    weight.refs[0].at[self.group, pl.ds(k0, block_k), pl.ds(self.col0, block_n)],
                    mask_2d(k_ok_K, self.cols_ok_N),
                )
                return plgpu.dot(lhs_MK, rhs_KN, allow_tf32=allow_tf32)
            rhs_NK = self.weight_tile(weight.load, k0, k_ok_K, dtype=lhs_MK.dtype)
            if weight_left:
                return plgpu.dot(rhs_NK, lhs_MK, trans_b=True, allow_tf32=allow_tf32)
            return plgpu.dot(lhs_MK, rhs_NK, trans_b=True, allow_tf32=allow_tf32)

        def step_products(step, k0, k_ok_K):
            lhs_MK = load_lhs(k0, k_ok_K)
            return (product(lhs_MK, weight, k0, k_ok_K) for weight in weights)

        accs = self.accumulate(step_products, len(weights), transposed=weight_left)
        return tuple(acc.T for acc in accs) if weight_left else accs

    def store(self, out_ref, value_MN):
        """out[row0 : row0 + block_m, col0 : col0 + block_n] = value in out's dtype, on the tile's own rows and the
        output's columns."""
        plgpu.store(
            out_ref.at[pl.ds(self.row0, self.shape.block_m), pl.ds(self.col0, self.shape.block_n)],
            value_MN.astype(out_ref.dtype),
            mask=mask_2d(self.rows_ok_M, self.cols_ok_N),
        )

    def scatter(self, out_ref, dest_ref, row_weight_ref, acc_MN):
        """out[dest[r], col0 : col0 + block_n] = row_weight[r] * acc[r] (in fp32, stored in out's dtype) for the
        tile's own rows r: dest [R] int32 and row_weight [R] fp32 refs over the sorted rows."""
        block_m = self.shape.block_m
        row_weight_M = masked_load(row_weight_ref.at[pl.ds(self.row0, block_m)], self.rows_ok_M)
        dest_M1 = self.row_indices(dest_ref, fill=out_ref.shape[0])[:, None]
        plgpu.store(
            out_ref.at[dest_M1, _columns(self.col0, self.shape.block_n)],
            (acc_MN * row_weight_M[:, None]).astype(out_ref.dtype),
            mask=mask_2d(self.rows_ok_M, self.cols_ok_N),
        )


def grouped_call(
    body,
    group_sizes_G,
    operands,
    out_shape,
    tiles: tuned.GroupedTiles,
    *,
    k_dim: int,
    interpret: bool,
    name: str,
    min_block_m: int | None = None,
    fill_tail: bool = True,
    columns: int = 1,
):
    """pallas_call of body(tile, *operand_refs, *out_refs) over the grid (column tile, row tile of `row_tiles`):
    `tile` the program's `Tile`, the operands and outputs whole. out_shape: a ShapeDtypeStruct [R, N] (R rows
    sorted by group, N the columns the grid covers), or a tuple of outputs of R rows, the first [R, N]; zeros for
    R = 0. A tile of fewer rows runs the body at the smallest of `row_tile_sizes(tiles.block_m, min_block_m)`
    that holds them. fill_tail False: the outputs' rows past sum(group_sizes) are left unwritten (undefined).
    columns > 1: a program owns that many consecutive column tiles (a body that walks them: `Tile.walk_columns`);
    its tile is the first of them."""
    num_rows, n_dim = jax.tree.leaves(out_shape)[0].shape
    if num_rows == 0:
        return jax.tree.map(lambda out: jnp.zeros(out.shape, out.dtype), out_shape)
    group_T, row_start_T, row_end_T = row_tiles(group_sizes_G, num_rows, tiles.block_m, fill_tail=fill_tail)
    shape = TileShape(tiles.block_m, tiles.block_n, tiles.block_k, n_dim, k_dim, group_sizes_G.shape[0])
    sizes = row_tile_sizes(tiles.block_m, min_block_m)

    def kernel(group_ref, row_start_ref, row_end_ref, *refs):
        column_tile = pl.program_id(0) * columns  # read outside the branches (Pallas's interpret mode needs that)

        def run(block_m: int):
            sized = dataclasses.replace(shape, block_m=block_m)
            return body(Tile.of_program(sized, column_tile, group_ref, row_start_ref, row_end_ref), *refs)

        if len(sizes) == 1:
            return run(sizes[0])
        rows = row_end_ref[...] - row_start_ref[...]
        index = sum(jnp.clip(rows - size, 0, 1) for size in sizes[:-1])  # a clip: see Tile.accumulate
        return jax.lax.switch(index, [functools.partial(run, size) for size in sizes])

    whole = lambda dims: pl.BlockSpec(dims, lambda n, t: (0,) * len(dims))  # noqa: E731
    per_row_tile = pl.BlockSpec((None,), lambda n, t: (t,))
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(pl.cdiv(n_dim, tiles.block_n), columns), group_T.shape[0]),
        in_specs=[per_row_tile, per_row_tile, per_row_tile, *(whole(op.shape) for op in operands)],
        out_specs=jax.tree.map(lambda out: whole(out.shape), out_shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name=name,
    )(group_T, row_start_T, row_end_T, *operands)
