"""Weight-only block-FP8 linear for decode-sized calls (a few rows), built to stream the e4m3 weight at HBM speed:
one Pallas program (Triton lowering) per strip of block_o outputs and range of K, no tile padded to 16 rows.

Each loop step loads blocks_per_step weight tiles [block_o, block_k] (block_k the weight's scale block, 128
inputs) before using any of them: rows of contiguous e4m3 (1 byte an element, the row stride and offsets static
multiples of 16, so Triton issues 16-byte vector loads), read once (evict-first). block_o divides the weight's row
block, so a tile takes one weight scale, folded into x's K block rather than into the weight. The products:

- FMA (fewer than dot_min_rows rows): per row of x, the tiles times x's K blocks (fp32, elementwise), summed along
  K once a step: M multiply-adds a weight byte on the CUDA cores, no padded rows;
- dot (dot_min_rows rows and more): each tile (cast to x's dtype, exact) times x^T [block_k, 16] on the tensor
  cores, the rows of x padded to 16 (the weight tile is the dot's left operand, so its rows fill the MMA).

The K steps are split over programs until there are min_programs of them (a decode-sized product has few output
strips); each split stores fp32 partial sums [splits, M, O], added after the kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.fp8 import tuned
from pallas_kernels.tuning import lookup

DOT_ROWS = 16  # x's rows padded to this for the tensor-core products (Triton's smallest dot)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The static shape of one launch: rows, outputs, inputs, the weight's (row, K) block, the loop steps, the
    steps a split runs, whether output and K edges are masked, and whether the products are dots."""

    num_rows: int
    n_dim: int
    k_dim: int
    block: tuple[int, int]
    num_steps: int
    steps_per_split: int
    mask_n: bool
    mask_k: bool
    use_dot: bool


def _load(ref, mask, **kwargs):
    return plgpu.load(ref, mask=mask, other=None if mask is None else 0.0, **kwargs)


def _kernel(x_ref, values_ref, scales_ref, y_ref, *, tiles: tuned.GemvTiles, layout: _Layout):
    block_rows, block_k = layout.block
    block_o, per_step = tiles.block_o, tiles.blocks_per_step
    num_k_blocks = pl.cdiv(layout.k_dim, block_k)
    col0 = pl.program_id(0) * block_o
    cols_ok_O = col0 + jnp.arange(block_o) < layout.n_dim if layout.mask_n else None
    scale_row = col0 // block_rows
    first_step = pl.program_id(1) * layout.steps_per_split
    last_step = jnp.minimum(first_step + layout.steps_per_split, layout.num_steps)

    def weight_tiles(step):
        """[(k0, k_ok_K, w_OK e4m3, scale)] of the step's K blocks, all loads issued before any use."""
        found = []
        for sub in range(per_step):
            k_block = step * per_step + sub
            k0 = k_block * block_k
            k_ok_K = k0 + jnp.arange(block_k) < layout.k_dim if layout.mask_k else None
            w_OK = _load(
                values_ref.at[pl.ds(col0, block_o), pl.ds(k0, block_k)],
                _mask(cols_ok_O, k_ok_K),
                eviction_policy="evict_first",
            )
            scale = scales_ref[scale_row, jnp.minimum(k_block, num_k_blocks - 1)]  # past the end: a zero tile
            found.append((k0, k_ok_K, w_OK, scale))
        return found

    def fma_step(step, acc_rows):
        found = weight_tiles(step)
        new_rows = []
        for row, acc_O in enumerate(acc_rows):
            sum_OK = jnp.zeros((block_o, block_k), jnp.float32)
            for k0, k_ok_K, w_OK, scale in found:
                x_K = _load(x_ref.at[jnp.int32(row), pl.ds(k0, block_k)], k_ok_K).astype(jnp.float32) * scale
                sum_OK = sum_OK + w_OK.astype(jnp.float32) * x_K[None, :]
            new_rows.append(acc_O + jnp.sum(sum_OK, axis=1))
        return tuple(new_rows)

    rows_ok_M = jnp.arange(DOT_ROWS) < layout.num_rows if layout.num_rows < DOT_ROWS else None

    def dot_step(step, acc_OM):
        for k0, k_ok_K, w_OK, scale in weight_tiles(step):
            x_MK = _load(x_ref.at[pl.ds(0, DOT_ROWS), pl.ds(k0, block_k)], _mask(rows_ok_M, k_ok_K))
            partial_OM = plgpu.dot(w_OK.astype(x_MK.dtype), x_MK, trans_b=True, allow_tf32=x_MK.dtype != jnp.float32)
            acc_OM = acc_OM + partial_OM * scale
        return acc_OM

    split = (pl.program_id(1),) if y_ref.ndim == 3 else ()
    if layout.use_dot:
        acc_OM = jax.lax.fori_loop(first_step, last_step, dot_step, jnp.zeros((block_o, DOT_ROWS), jnp.float32))
        plgpu.store(
            y_ref.at[(*split, pl.ds(0, DOT_ROWS), pl.ds(col0, block_o))],
            acc_OM.T.astype(y_ref.dtype),
            mask=_mask(rows_ok_M, cols_ok_O),
        )
        return
    zeros = tuple(jnp.zeros((block_o,), jnp.float32) for _ in range(layout.num_rows))
    acc_rows = jax.lax.fori_loop(first_step, last_step, fma_step, zeros)
    for row, acc_O in enumerate(acc_rows):
        plgpu.store(y_ref.at[(*split, jnp.int32(row), pl.ds(col0, block_o))], acc_O.astype(y_ref.dtype), mask=cols_ok_O)


def _mask(rows_ok, cols_ok):
    """rows_ok[:, None] & cols_ok[None, :]; None stands for all true (both None: no mask)."""
    if rows_ok is None:
        return None if cols_ok is None else cols_ok[None, :]
    return rows_ok[:, None] if cols_ok is None else rows_ok[:, None] & cols_ok[None, :]


def _layout(num_rows: int, n_dim: int, k_dim: int, block: tuple[int, int], tiles: tuned.GemvTiles):
    """(tiles with block_o cut to the weight's row block and the outputs, the launch's _Layout, the splits)."""
    block_rows, block_k = block
    use_dot = num_rows >= tiles.dot_min_rows
    block_o = max(DOT_ROWS if use_dot else 1, min(tiles.block_o, block_rows, pl.next_power_of_2(n_dim)))
    tiles = dataclasses.replace(tiles, block_o=block_o)
    num_k_blocks = -(-k_dim // block_k)
    num_steps = -(-num_k_blocks // tiles.blocks_per_step)
    num_strips = -(-n_dim // block_o)
    wanted_splits = max(1, min(num_steps, -(-tiles.min_programs // num_strips)))
    steps_per_split = -(-num_steps // wanted_splits)
    layout = _Layout(
        num_rows=num_rows,
        n_dim=n_dim,
        k_dim=k_dim,
        block=block,
        num_steps=num_steps,
        steps_per_split=steps_per_split,
        mask_n=n_dim % block_o != 0,
        mask_k=num_steps * tiles.blocks_per_step * block_k != k_dim,
        use_dot=use_dot,
    )
    return tiles, layout, -(-num_steps // steps_per_split)


@functools.partial(jax.jit, static_argnames=("block", "tiles", "interpret"))
def weight_only_gemv_gpu(
    x_MK,
    values_NK,
    scales,
    *,
    block: tuple[int, int],
    tiles: tuned.GemvTiles | None = None,
    interpret: bool = False,
) -> jax.Array:
    """y [M, N] in x's dtype: x [M, K] (M <= tuned.GEMV_MAX_ROWS; bf16, fp16 or fp32) times the block-FP8 weight
    (values [N, K] e4m3, scales [ceil(N / block[0]), ceil(K / block[1])], block powers of two) transposed, fp32
    accumulation, each K block's partial sums times its weight scale (module docstring). Tiles: None from
    `tuned.WEIGHT_ONLY_GEMV`."""
    num_rows, k_dim = x_MK.shape
    if num_rows > tuned.GEMV_MAX_ROWS:
        raise ValueError(f"the decode-shaped FP8 kernel takes at most {tuned.GEMV_MAX_ROWS} rows, got {num_rows}")
    n_dim = values_NK.shape[0]
    tiles = tiles or lookup(tuned.WEIGHT_ONLY_GEMV, dtype=x_MK.dtype)
    tiles, layout, k_splits = _layout(num_rows, n_dim, k_dim, tuple(block), tiles)
    out_shape = (k_splits, num_rows, n_dim) if k_splits > 1 else (num_rows, n_dim)
    whole = lambda shape: pl.BlockSpec(shape, lambda strip, split: (0,) * len(shape))  # noqa: E731
    y = pl.pallas_call(
        functools.partial(_kernel, tiles=tiles, layout=layout),
        grid=(-(-n_dim // tiles.block_o), k_splits),
        in_specs=[whole(x_MK.shape), whole(values_NK.shape), whole(scales.shape)],
        out_specs=whole(out_shape),
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32 if k_splits > 1 else x_MK.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="weight_only_gemv",
    )(x_MK, values_NK, scales.astype(jnp.float32))
    return jnp.sum(y, axis=0).astype(x_MK.dtype) if k_splits > 1 else y
