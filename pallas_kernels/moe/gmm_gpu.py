"""Grouped matmul on GPU: a Pallas kernel (Triton lowering) over the unpadded, group-sorted rows.

Program (column tile, row tile) owns one [block_m, block_n] tile of the output, so no two programs write
the same memory. It walks the groups that overlap its rows (their range per row tile is found with jnp
before the call); for each non-empty one it runs a K loop of dots of the tile's rows, masked to that
group's rows, against that group's weight, all into one fp32 accumulator. Nothing is padded, scattered or
gathered: a row tile that straddles a boundary costs one extra K loop per extra group instead, about what
padding each group to a multiple of block_m would cost in dots. Column tiles vary fastest in the grid so
the programs sharing a row tile of lhs run together (L2 reuse).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _kernel(first_group_ref, last_group_ref, offsets_ref, lhs_ref, rhs_ref, out_ref, *, block_m: int,
            block_n: int, block_k: int, mask_n: bool, mask_k: bool):
    num_rows, k_dim = lhs_ref.shape
    n_dim = rhs_ref.shape[1]
    row0 = pl.program_id(1) * block_m
    col0 = pl.program_id(0) * block_n
    rows_M = row0 + jnp.arange(block_m)
    cols_N = col0 + jnp.arange(block_n)
    cols_ok_N1 = (cols_N < n_dim)[:, None] if mask_n else None
    dot = functools.partial(plgpu.dot, trans_b=True, allow_tf32=lhs_ref.dtype != jnp.float32)
    num_k_steps = pl.cdiv(k_dim, block_k)

    def group_body(group, acc_MN):
        start, end = offsets_ref[group], offsets_ref[group + 1]
        in_group_M1 = ((rows_M >= start) & (rows_M < end))[:, None]

        def k_body(step, acc_MN):
            k0 = step * block_k
            lhs_mask, rhs_mask = in_group_M1, cols_ok_N1
            if mask_k:
                k_ok_1K = (k0 + jnp.arange(block_k) < k_dim)[None, :]
                lhs_mask = lhs_mask & k_ok_1K
                rhs_mask = k_ok_1K if rhs_mask is None else rhs_mask & k_ok_1K
            lhs_MK = plgpu.load(lhs_ref.at[pl.ds(row0, block_m), pl.ds(k0, block_k)], mask=lhs_mask, other=0.0)
            rhs_NK = plgpu.load(rhs_ref.at[group, pl.ds(col0, block_n), pl.ds(k0, block_k)], mask=rhs_mask,
                                other=None if rhs_mask is None else 0.0)
            return acc_MN + dot(lhs_MK, rhs_NK)

        # No K steps for an empty group: a min, as Triton's lowering turns a jnp.where of two constants into i1.
        return jax.lax.fori_loop(0, jnp.minimum(end - start, 1) * num_k_steps, k_body, acc_MN)

    acc_MN = jax.lax.fori_loop(first_group_ref[...], last_group_ref[...] + 1, group_body,
                               jnp.zeros((block_m, block_n), jnp.float32))
    out_mask = (rows_M < num_rows)[:, None]
    if mask_n:
        out_mask = out_mask & (cols_N < n_dim)[None, :]
    plgpu.store(out_ref.at[pl.ds(row0, block_m), pl.ds(col0, block_n)], acc_MN.astype(out_ref.dtype),
                mask=out_mask)


def group_ranges(group_sizes_G, num_rows: int, block_m: int):
    """(offsets [G + 1], first and last group overlapping each row tile [T]) as int32.

    Offsets are clipped to num_rows so an oversized group_sizes can never make the kernel read past lhs.
    A row tile past the last used row gets first = G > last, an empty walk, and writes zeros.
    """
    num_groups = group_sizes_G.shape[0]
    ends_G = jnp.minimum(jnp.cumsum(group_sizes_G.astype(jnp.int32)), num_rows)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_G])
    tile_first_row_T = jnp.arange(pl.cdiv(num_rows, block_m), dtype=jnp.int32) * block_m
    tile_last_row_T = jnp.minimum(tile_first_row_T + block_m, num_rows) - 1
    first_T = jnp.searchsorted(ends_G, tile_first_row_T, side="right").astype(jnp.int32)
    last_T = jnp.minimum(jnp.searchsorted(ends_G, tile_last_row_T, side="right"), num_groups - 1)
    return offsets, first_T, last_T.astype(jnp.int32)


# (block_m, block_n, block_k, num_warps, num_stages) by lhs itemsize. block_m stays small because every
# group boundary inside a row tile costs a K loop over the whole tile.
DEFAULT_TILES = {2: (64, 128, 64, 4, 4), 4: (64, 64, 32, 4, 3)}


def _tile(size: int, wanted: int) -> int:
    """Triton tiles are powers of two, and its dots want at least 16 per side."""
    return max(16, min(wanted, pl.next_power_of_2(size)))


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_warps", "num_stages",
                                             "interpret"))
def grouped_matmul_gpu(lhs_MK, rhs_GNK, group_sizes_G, *, block_m: int | None = None, block_n: int | None = None,
                       block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                       interpret: bool = False):
    """out [M, N] in lhs's dtype (fp32 accumulation): out[rows of g] = lhs[rows of g] @ rhs[g].T.

    rhs is cast to lhs's dtype; bf16 products use the tensor cores, fp32 ones stay IEEE fp32 (no tf32).
    Tile sizes and launch settings default to DEFAULT_TILES for lhs's dtype; tiles are powers of two.
    """
    num_rows, k_dim = lhs_MK.shape
    num_groups, n_dim, _ = rhs_GNK.shape
    if num_rows == 0:
        return jnp.zeros((0, n_dim), lhs_MK.dtype)
    defaults = DEFAULT_TILES.get(lhs_MK.dtype.itemsize, DEFAULT_TILES[4])
    block_m, block_n, block_k, num_warps, num_stages = (
        given or default for given, default in zip((block_m, block_n, block_k, num_warps, num_stages), defaults))
    block_m, block_n, block_k = _tile(num_rows, block_m), _tile(n_dim, block_n), _tile(k_dim, block_k)
    offsets, first_T, last_T = group_ranges(group_sizes_G, num_rows, block_m)
    kernel = functools.partial(_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
                               mask_n=n_dim % block_n != 0, mask_k=k_dim % block_k != 0)
    whole = lambda shape: pl.BlockSpec(shape, lambda n, m: (0,) * len(shape))  # noqa: E731
    per_row_tile = pl.BlockSpec((None,), lambda n, m: (m,))
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n_dim, block_n), pl.cdiv(num_rows, block_m)),
        in_specs=[per_row_tile, per_row_tile, whole((num_groups + 1,)), whole(lhs_MK.shape),
                  whole(rhs_GNK.shape)],
        out_specs=whole((num_rows, n_dim)),
        out_shape=jax.ShapeDtypeStruct((num_rows, n_dim), lhs_MK.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )(first_T, last_T, offsets, lhs_MK, rhs_GNK.astype(lhs_MK.dtype))
