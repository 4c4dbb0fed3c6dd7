"""Weight-only block-FP8 linear for decode-sized calls (a few rows), built to stream the e4m3 weight at HBM speed:
one Pallas program (Triton lowering) per strip of block_o outputs and range of K, no tile padded to 16 rows.

Each loop step loads blocks_per_step weight tiles [block_o, block_k] (block_k the weight's scale block, 128
inputs) before using any of them: rows of contiguous e4m3 (1 byte an element, the row stride and offsets static
multiples of 16, so Triton issues 16-byte vector loads), read once (evict-first). block_o divides the weight's row
block, so a tile takes one weight scale, folded into x's K block rather than into the weight. The products:

- FMA (fewer than dot_min_rows rows): tile by tile (its e4m3 widened to fp32 once for every row), per row of x the
  tile times x's K block (elementwise), summed along K once a step, after every K block, or once after the loop
  (tiles.sum_k: a [block_o] accumulator a row summed each block takes fewer registers than [block_o, block_k] sums
  held, which several rows need; held over the loop, the loop has no cross-thread sums): M multiply-adds a weight
  byte on the CUDA cores, no padded rows;
- dot (dot_min_rows rows and more): each tile (cast to x's dtype, exact) times x^T [block_k, 16] on the tensor
  cores, the rows of x padded to 16 (the weight tile is the dot's left operand, so its rows fill the MMA).

The K steps are split over programs until there are min_programs of them (a decode-sized product has few output
strips); each split stores fp32 partial sums [splits, M, O], added after the kernel, or by the next kernel
(`weight_only_gemv_partials_gpu` returns them unreduced: the output projection's residual add + RMSNorm adds them).

`weight_only_gemv_partials_gpu` may normalise x first (`reference.GatedHeadNorm`, KDA's gated output norm, as its
next kernel would have): each program reads x in K blocks, and where a head's D values are whole K blocks (D a
multiple of the weight's K block), the program forms the norm of the heads it reads itself (the head's sum of squares
from the D values, rsqrt, the norm weight, the gate's sigmoid, rounded to x's dtype) before the products; the norm
then needs no kernel of its own.

`weight_only_gemv_many_gpu` runs several weights that multiply the same x (a layer's input projections) in one
launch: its grid is the union of their output strips, each program picking its weight by static strip ranges, so
the strips together fill the GPU with fewer (often no) K splits, and the splits left are added in one reduction for
the whole group rather than one a weight.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.fp8 import tuned
from pallas_kernels.fp8.reference import GatedHeadNorm
from pallas_kernels.triton_masked import mask_2d, masked_load
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


@dataclasses.dataclass(frozen=True)
class _HeadNorm:
    """The gated head norm in a program: the gate's and the norm weight's refs, the head size D, eps."""

    gate_ref: object
    weight_ref: object
    head_dim: int
    eps: float

    def apply(self, x, x_ref, rows, k0, mask):
        """x's K block at k0 (x_ref's `rows`: one row [block_k], or DOT_ROWS [DOT_ROWS, block_k]; `mask` its load's)
        normalised over its head (`reference.gated_head_norm`), in x's dtype: a head of several K blocks has its
        sum of squares from all of them."""
        block_k, head_dim = x.shape[-1], self.head_dim
        x_f32 = x.astype(jnp.float32)
        if head_dim == block_k:
            squares = jnp.sum(x_f32 * x_f32, axis=-1, keepdims=True)
        else:
            head0 = k0 - k0 % head_dim
            pieces = [
                masked_load(x_ref.at[rows, pl.ds(head0 + start, block_k)], mask).astype(jnp.float32)
                for start in range(0, head_dim, block_k)
            ]
            squares = sum(jnp.sum(piece * piece, axis=-1, keepdims=True) for piece in pieces)
        inverse_rms = jax.lax.rsqrt(squares / head_dim + self.eps)
        weight_K = self.weight_ref[pl.ds(k0 % head_dim, block_k)].astype(jnp.float32)
        gate = jax.nn.sigmoid(masked_load(self.gate_ref.at[rows, pl.ds(k0, block_k)], mask).astype(jnp.float32))
        return (x_f32 * inverse_rms * weight_K * gate).astype(x.dtype)


def _kernel(x_ref, values_ref, scales_ref, *refs, tiles: tuned.GemvTiles, layout: _Layout, eps: float | None):
    """refs: the gated head norm's gate and weight where eps is given, then y."""
    *norm_refs, y_ref = refs
    norm = None if eps is None else _HeadNorm(*norm_refs, head_dim=norm_refs[1].shape[0], eps=eps)
    _strip(
        x_ref,
        values_ref,
        scales_ref,
        y_ref,
        pl.program_id(0),
        pl.program_id(1),
        tiles=tiles,
        layout=layout,
        y_col0=0,
        norm=norm,
    )


def _strip(
    x_ref,
    values_ref,
    scales_ref,
    y_ref,
    strip,
    split,
    *,
    tiles: tuned.GemvTiles,
    layout: _Layout,
    y_col0: int,
    norm: _HeadNorm | None = None,
):
    """One program's work: outputs [strip * block_o, + block_o) of the weight over the K steps of `split`, stored
    in y's columns from y_col0 + strip * block_o (y [M, N], or fp32 partial sums [splits, M, N]); norm: x's blocks
    normalised as they are read."""
    block_rows, block_k = layout.block
    block_o, per_step = tiles.block_o, tiles.blocks_per_step
    num_k_blocks = pl.cdiv(layout.k_dim, block_k)
    col0 = strip * block_o
    cols_ok_O = col0 + jnp.arange(block_o) < layout.n_dim if layout.mask_n else None
    scale_row = col0 // block_rows
    first_step = split * layout.steps_per_split
    last_step = jnp.minimum(first_step + layout.steps_per_split, layout.num_steps)

    def x_block(rows, k0, mask):
        x = masked_load(x_ref.at[rows, pl.ds(k0, block_k)], mask)
        return x if norm is None else norm.apply(x, x_ref, rows, k0, mask)

    def weight_tiles(step):
        """[(k0, k_ok_K, w_OK e4m3, scale)] of the step's K blocks, all loads issued before any use."""
        found = []
        for sub in range(per_step):
            k_block = step * per_step + sub
            k0 = k_block * block_k
            k_ok_K = k0 + jnp.arange(block_k) < layout.k_dim if layout.mask_k else None
            w_OK = masked_load(
                values_ref.at[pl.ds(col0, block_o), pl.ds(k0, block_k)],
                mask_2d(cols_ok_O, k_ok_K),
                eviction_policy="evict_first",
            )
            scale = scales_ref[scale_row, jnp.minimum(k_block, num_k_blocks - 1)]  # past the end: a zero tile
            found.append((k0, k_ok_K, w_OK, scale))
        return found

    def fma_step(step, acc_rows):
        """Each K block's products, tile by tile (its e4m3 values widened once for every row), summed along K as
        tiles.sum_k says: after each block into [block_o] accumulators, or held [block_o, block_k] a row and summed
        once the step is done (SUM_EACH_STEP) or once the loop is (SUM_AFTER_LOOP: acc_rows are the held sums)."""
        found = weight_tiles(step)
        each_block = tiles.sum_k == tuned.SUM_EACH_BLOCK
        each_step = tiles.sum_k == tuned.SUM_EACH_STEP
        sums = [jnp.zeros((block_o, block_k), jnp.float32) for _ in acc_rows] if each_step else list(acc_rows)
        for k0, k_ok_K, w_OK, scale in found:
            x_rows_K = [x_block(jnp.int32(row), k0, k_ok_K).astype(jnp.float32) * scale for row in range(len(sums))]
            w_f32_OK = w_OK.astype(jnp.float32)
            products = (w_f32_OK * x_K[None, :] for x_K in x_rows_K)
            sums = [total + (jnp.sum(p_OK, axis=1) if each_block else p_OK) for total, p_OK in zip(sums, products)]
        if each_step:
            return tuple(acc_O + jnp.sum(sum_OK, axis=1) for acc_O, sum_OK in zip(acc_rows, sums))
        return tuple(sums)

    rows_ok_M = jnp.arange(DOT_ROWS) < layout.num_rows if layout.num_rows < DOT_ROWS else None

    def dot_step(step, acc_OM):
        for k0, k_ok_K, w_OK, scale in weight_tiles(step):
            x_MK = x_block(pl.ds(0, DOT_ROWS), k0, mask_2d(rows_ok_M, k_ok_K))
            partial_OM = plgpu.dot(w_OK.astype(x_MK.dtype), x_MK, trans_b=True, allow_tf32=x_MK.dtype != jnp.float32)
            acc_OM = acc_OM + partial_OM * scale
        return acc_OM

    split_at = (split,) if y_ref.ndim == 3 else ()
    if layout.use_dot:
        acc_OM = jax.lax.fori_loop(first_step, last_step, dot_step, jnp.zeros((block_o, DOT_ROWS), jnp.float32))
        plgpu.store(
            y_ref.at[(*split_at, pl.ds(0, DOT_ROWS), pl.ds(y_col0 + col0, block_o))],
            acc_OM.T.astype(y_ref.dtype),
            mask=mask_2d(rows_ok_M, cols_ok_O),
        )
        return
    after_loop = tiles.sum_k == tuned.SUM_AFTER_LOOP
    acc_shape = (block_o, block_k) if after_loop else (block_o,)
    zeros = tuple(jnp.zeros(acc_shape, jnp.float32) for _ in range(layout.num_rows))
    acc_rows = jax.lax.fori_loop(first_step, last_step, fma_step, zeros)
    if after_loop:
        acc_rows = tuple(jnp.sum(acc_OK, axis=1) for acc_OK in acc_rows)
    for row, acc_O in enumerate(acc_rows):
        plgpu.store(
            y_ref.at[(*split_at, jnp.int32(row), pl.ds(y_col0 + col0, block_o))],
            acc_O.astype(y_ref.dtype),
            mask=cols_ok_O,
        )


def _strip_tiles(num_rows: int, n_dim: int, block: tuple[int, int], tiles: tuned.GemvTiles) -> tuned.GemvTiles:
    """tiles with block_o cut to the weight's row block and its outputs."""
    use_dot = num_rows >= tiles.dot_min_rows
    block_o = max(DOT_ROWS if use_dot else 1, min(tiles.block_o, block[0], pl.next_power_of_2(n_dim)))
    return dataclasses.replace(tiles, block_o=block_o)


def _num_strips(n_dim: int, tiles: tuned.GemvTiles) -> int:
    return -(-n_dim // tiles.block_o)


def _layout(num_rows: int, n_dim: int, k_dim: int, block: tuple[int, int], tiles: tuned.GemvTiles, strips: int):
    """(the launch's _Layout for one weight, the K splits) with `tiles` from `_strip_tiles`: the K steps split until
    the launch's `strips` output strips times the splits reach tiles.min_programs."""
    block_k = block[1]
    num_k_blocks = -(-k_dim // block_k)
    num_steps = -(-num_k_blocks // tiles.blocks_per_step)
    wanted_splits = max(1, min(num_steps, -(-tiles.min_programs // strips)))
    steps_per_split = -(-num_steps // wanted_splits)
    layout = _Layout(
        num_rows=num_rows,
        n_dim=n_dim,
        k_dim=k_dim,
        block=block,
        num_steps=num_steps,
        steps_per_split=steps_per_split,
        mask_n=n_dim % tiles.block_o != 0,
        mask_k=num_steps * tiles.blocks_per_step * block_k != k_dim,
        use_dot=num_rows >= tiles.dot_min_rows,
    )
    return layout, -(-num_steps // steps_per_split)


def _whole(shape):
    """The BlockSpec of an operand every program sees whole (the kernel indexes it itself)."""
    return pl.BlockSpec(shape, lambda strip, split: (0,) * len(shape))


def _checked_tiles(x_MK, tiles: tuned.GemvTiles | None) -> tuned.GemvTiles:
    if x_MK.shape[0] > tuned.GEMV_MAX_ROWS:
        raise ValueError(f"the decode-shaped FP8 kernel takes at most {tuned.GEMV_MAX_ROWS} rows, got {x_MK.shape[0]}")
    return tiles or lookup(tuned.WEIGHT_ONLY_GEMV, dtype=x_MK.dtype, bucket=tuned.gemv_bucket(x_MK.shape[0]))


def _gemv_call(
    x_MK,
    values_NK,
    scales,
    block: tuple[int, int],
    tiles: tuned.GemvTiles | None,
    interpret: bool,
    *,
    partials: bool,
    norm: GatedHeadNorm | None = None,
):
    """The single-weight launch: y [M, N] in x's dtype where it runs one K split and partials is False, else the
    fp32 partial sums [splits, M, N] (one split: [1, M, N]); norm: x normalised head by head first."""
    num_rows, k_dim = x_MK.shape
    n_dim = values_NK.shape[0]
    norm_inputs = []
    if norm is not None:
        head_dim = norm.weight_D.shape[0]
        if norm.gate.shape != x_MK.shape or k_dim % head_dim or head_dim % block[1]:
            raise ValueError(
                f"FP8 gemv's gated head norm: the gate shaped like x {x_MK.shape}, heads that tile K in whole K blocks "
                f"of {block[1]}; got the gate {norm.gate.shape}, heads of {head_dim}"
            )
        norm_inputs = [norm.gate, norm.weight_D]
    tiles = _strip_tiles(num_rows, n_dim, tuple(block), _checked_tiles(x_MK, tiles))
    layout, k_splits = _layout(num_rows, n_dim, k_dim, tuple(block), tiles, _num_strips(n_dim, tiles))
    split = partials or k_splits > 1
    out_shape = (k_splits, num_rows, n_dim) if split else (num_rows, n_dim)
    return pl.pallas_call(
        functools.partial(_kernel, tiles=tiles, layout=layout, eps=None if norm is None else norm.eps),
        grid=(_num_strips(n_dim, tiles), k_splits),
        in_specs=[_whole(x_MK.shape), _whole(values_NK.shape), _whole(scales.shape)]
        + [_whole(a.shape) for a in norm_inputs],
        out_specs=_whole(out_shape),
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32 if split else x_MK.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="weight_only_gemv" if norm is None else "weight_only_gemv_gated_norm",
    )(x_MK, values_NK, scales.astype(jnp.float32), *norm_inputs)


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
    y = _gemv_call(x_MK, values_NK, scales, tuple(block), tiles, interpret, partials=False)
    return jnp.sum(y, axis=0).astype(x_MK.dtype) if y.ndim == 3 else y


@functools.partial(jax.jit, static_argnames=("block", "tiles", "interpret"))
def weight_only_gemv_partials_gpu(
    x_MK,
    values_NK,
    scales,
    *,
    block: tuple[int, int],
    tiles: tuned.GemvTiles | None = None,
    interpret: bool = False,
    norm: GatedHeadNorm | None = None,
) -> jax.Array:
    """`weight_only_gemv_gpu`'s fp32 partial sums [splits, M, N], left unreduced for the next kernel to add
    (`pallas_kernels.norm.add_partials_rms_norm`): jnp.sum(partials, axis=0) cast to x's dtype is
    `weight_only_gemv_gpu`'s y. One K split: [1, M, N]. norm: the product's x is `reference.gated_head_norm(x,
    norm)`, formed in the kernel as it reads x (module docstring: heads of whole K blocks tiling K, the gate [M, K],
    norm.weight_D [D]); None: x as it is, the plain gemv."""
    return _gemv_call(x_MK, values_NK, scales, tuple(block), tiles, interpret, partials=True, norm=norm)


@dataclasses.dataclass(frozen=True)
class _Part:
    """One weight of a grouped launch: its tiles and layout, its first strip in the launch's grid, its strips, and
    its first column in the partial sums' [splits, M, sum of N]."""

    tiles: tuned.GemvTiles
    layout: _Layout
    first_strip: int
    num_strips: int
    y_col0: int


def _many_kernel(x_ref, *refs, parts: tuple[_Part, ...]):
    """Each program runs the strip of the weight whose static strip range holds program_id(0)."""
    count = len(parts)
    values_refs, scales_refs, y_refs = refs[:count], refs[count : 2 * count], refs[2 * count :]
    strip, split = pl.program_id(0), pl.program_id(1)  # read here: interpret mode has none inside a branch
    for i, part in enumerate(parts):
        y_ref, y_col0 = (y_refs[0], part.y_col0) if len(y_refs) == 1 else (y_refs[i], 0)

        @pl.when((strip >= part.first_strip) & (strip < part.first_strip + part.num_strips))
        def _(i=i, part=part, y_ref=y_ref, y_col0=y_col0):
            local = strip - part.first_strip
            _strip(
                x_ref,
                values_refs[i],
                scales_refs[i],
                y_ref,
                local,
                split,
                tiles=part.tiles,
                layout=part.layout,
                y_col0=y_col0,
            )


@functools.partial(jax.jit, static_argnames=("blocks", "tiles", "interpret"))
def weight_only_gemv_many_gpu(
    x_MK,
    values,
    scales,
    *,
    blocks: tuple[tuple[int, int], ...],
    tiles: tuned.GemvTiles | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """(x @ W_i^T for each block-FP8 weight W_i: values[i] [N_i, K], scales[i], blocks[i]) in one launch: the grid
    runs over the union of the weights' output strips (weight after weight), so together they fill the GPU with
    fewer K splits than each alone. Where splits remain, every weight's fp32 partial sums land in one
    [splits, M, sum of N] array, added once after the kernel (one reduction for the group, a fixed order). Each y_i
    is `weight_only_gemv_gpu`'s product with the launch's split count: bit-identical where that equals the weight's
    own, else the same sums regrouped over K. The weights share K and the scale block's K size (blocks[i][1])."""
    num_rows, k_dim = x_MK.shape
    tiles = _checked_tiles(x_MK, tiles)
    if len({block[1] for block in blocks}) != 1 or any(v.shape[1] != k_dim for v in values):
        raise ValueError(f"grouped FP8 gemv: the weights must share K {k_dim} and the K block, got blocks {blocks}")
    part_tiles = [_strip_tiles(num_rows, v.shape[0], tuple(b), tiles) for v, b in zip(values, blocks)]
    strips = [_num_strips(v.shape[0], t) for v, t in zip(values, part_tiles)]
    parts, first_strip, y_col0, k_splits = [], 0, 0, 1
    for v, b, t, n_strips in zip(values, blocks, part_tiles, strips):
        layout, k_splits = _layout(num_rows, v.shape[0], k_dim, tuple(b), t, sum(strips))
        parts.append(_Part(t, layout, first_strip, n_strips, y_col0))
        first_strip, y_col0 = first_strip + n_strips, y_col0 + v.shape[0]
    n_dims = [v.shape[0] for v in values]
    if k_splits > 1:
        out_shapes = [jax.ShapeDtypeStruct((k_splits, num_rows, sum(n_dims)), jnp.float32)]
    else:
        out_shapes = [jax.ShapeDtypeStruct((num_rows, n), x_MK.dtype) for n in n_dims]
    ys = pl.pallas_call(
        functools.partial(_many_kernel, parts=tuple(parts)),
        grid=(first_strip, k_splits),
        in_specs=[_whole(x_MK.shape), *(_whole(v.shape) for v in values), *(_whole(s.shape) for s in scales)],
        out_specs=[_whole(shape.shape) for shape in out_shapes],
        out_shape=out_shapes,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="weight_only_gemv_many",
    )(x_MK, *values, *(s.astype(jnp.float32) for s in scales))
    if k_splits == 1:
        return tuple(ys)
    y_MN = jnp.sum(ys[0], axis=0).astype(x_MK.dtype)
    return tuple(jnp.split(y_MN, list(itertools.accumulate(n_dims[:-1])), axis=1))
