"""The MoE Triton kernels' grouped skeleton (`pallas_kernels.moe.gpu_triton.grouped`) on its own, in Pallas
interpret mode: which group and row-tile size each row's program runs at, and the K loop's coverage of K."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe import tuned
from pallas_kernels.moe.gpu_triton.grouped import grouped_call, launch_settings, row_tile_sizes

GROUP_SIZES = [5, 0, 40, 17]  # 62 of 70 rows: a tail of 8
NUM_ROWS, N_DIM, K_DIM = 70, 24, 40  # a partial column tile and a partial K step at 16 x 16 tiles
TILES = tuned.GroupedTiles(block_m=32, block_n=16, block_k=16, num_warps=4, num_stages=1)
MIN_BLOCK_M = 16


def _program_facts(tile, group_ref, block_m_ref, k_covered_ref):
    """Each row's group, the row-tile size its program ran at, and how many K inputs its K loop covered."""
    full = (tile.shape.block_m, tile.shape.block_n)

    def step_products(step, k0, k_ok_K):
        covered = tile.shape.block_k if k_ok_K is None else jnp.sum(k_ok_K.astype(jnp.float32))
        return (jnp.full(full, covered, jnp.float32),)

    (k_covered_MN,) = tile.accumulate(step_products, 1)
    tile.store(group_ref, jnp.full(full, tile.group, jnp.int32))
    tile.store(block_m_ref, jnp.full(full, tile.shape.block_m, jnp.int32))
    tile.store(k_covered_ref, k_covered_MN)


def test_programs_cover_each_group_at_the_smallest_row_tile_that_holds_its_rows():
    out = jax.ShapeDtypeStruct((NUM_ROWS, N_DIM), jnp.int32)
    group_R, block_m_R, k_covered_R = (
        np.asarray(a)
        for a in grouped_call(
            _program_facts,
            jnp.asarray(GROUP_SIZES, jnp.int32),
            (),
            (out, out, jax.ShapeDtypeStruct((NUM_ROWS, N_DIM), jnp.float32)),
            TILES,
            k_dim=K_DIM,
            interpret=True,
            name="program_facts",
            min_block_m=MIN_BLOCK_M,
        )
    )
    assert row_tile_sizes(TILES.block_m, MIN_BLOCK_M) == (16, 32)
    num_groups = len(GROUP_SIZES)
    # (group, rows, row-tile size) of each tile in row order: the tail is group G, and runs no K steps
    expected = [(0, 5, 16), (2, 32, 32), (2, 8, 16), (3, 17, 32), (num_groups, 8, 16)]
    row = 0
    for group, rows, block_m in expected:
        assert (group_R[row : row + rows] == group).all(), (group, row)
        assert (block_m_R[row : row + rows] == block_m).all(), (group, row)
        assert (k_covered_R[row : row + rows] == (K_DIM if group < num_groups else 0)).all(), (group, row)
        row += rows
    assert row == NUM_ROWS


def test_launch_settings_fit_the_tuned_tiles_to_the_problem():
    """A few rows a group take the table's "few_rows" entry, its tiles cut to powers of two that fit N and K."""
    few_rows = dict(dtype=jnp.bfloat16, num_rows=8, num_groups=4, n_dim=N_DIM, k_dim=K_DIM)
    table = tuned.GROUPED_MATMUL
    assert launch_settings(table, (None,) * 5, **few_rows) == tuned.GroupedTiles(16, 32, 64, 4, 4)
    assert launch_settings(table, (64, 16, None, 8, None), **few_rows) == tuned.GroupedTiles(16, 16, 64, 8, 4)
