"""RMSNorm on GPU: one Pallas kernel (Triton lowering), optionally with the residual add in front.

Program = one row of D values held in registers: (residual add, stored), the fp32 mean of squares, the
normalised row rounded to the input dtype, times the weight in that dtype (computed exactly in fp32, then
rounded, which is what a bf16 multiply is). A decode step's norms are rows of 4096: XLA runs each as a
reduction kernel plus an elementwise kernel (plus one for the add); this is one launch.

`add_partials_rms_norm_gpu` takes, in place of the product in front, its fp32 partial sums [S, N, D] (a split-K
gemv's, `weight_only_gemv_partials_gpu`) and adds them first, split after split (a fixed order, whatever the rows;
no atomics), so the product's reduction needs no launch of its own. Its rows may have any width: the program loads
the next power of two of D values, the ones past D masked (Ling-3.0-flash's rows are 2,560 wide).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.norm import tuned
from pallas_kernels.tuning import lookup


def _normalise(total_D, weight_D, eps: float, dtype, dim: int | None = None):
    """The norm of one row, as `rms_norm_reference` computes it; dim: the row's width where total_D ends in zeros
    past it (None: all of total_D)."""
    total_f32 = total_D.astype(jnp.float32)
    mean_square = jnp.sum(total_f32 * total_f32) / (dim or total_D.shape[0])
    normed = (total_f32 * jax.lax.rsqrt(mean_square + eps)).astype(dtype)
    return (weight_D.astype(dtype).astype(jnp.float32) * normed.astype(jnp.float32)).astype(dtype)


def _norm_kernel(x_ref, weight_ref, out_ref, *, eps: float):
    out_ref[...] = _normalise(x_ref[...], weight_ref[...], eps, out_ref.dtype)


def _add_norm_kernel(x_ref, residual_ref, weight_ref, total_ref, out_ref, *, eps: float):
    total = x_ref[...].astype(jnp.float32) + residual_ref[...].astype(x_ref.dtype).astype(jnp.float32)
    total = total.astype(total_ref.dtype)
    total_ref[...] = total
    out_ref[...] = _normalise(total, weight_ref[...], eps, out_ref.dtype)


def _add_partials_norm_kernel(x_ref, partials_ref, weight_ref, total_ref, out_ref, *, eps: float):
    """One row: x + (the partials added in split order, cast to x's dtype), stored, and its norm."""
    dim = x_ref.shape[1]
    width = pl.next_power_of_2(dim)
    row, cols = pl.program_id(0), pl.ds(0, width)
    cols_ok_D = jnp.arange(width) < dim if width != dim else None

    def load(ref, *at):
        return plgpu.load(ref.at[(*at, cols)], mask=cols_ok_D, other=None if cols_ok_D is None else 0.0)

    y_D = load(partials_ref, jnp.int32(0), row)
    for split in range(1, partials_ref.shape[0]):
        y_D = y_D + load(partials_ref, jnp.int32(split), row)
    x_D = load(x_ref, row)
    total_D = (x_D.astype(jnp.float32) + y_D.astype(x_D.dtype).astype(jnp.float32)).astype(total_ref.dtype)
    plgpu.store(total_ref.at[row, cols], total_D, mask=cols_ok_D)
    out_D = _normalise(total_D, load(weight_ref), eps, out_ref.dtype, dim)
    plgpu.store(out_ref.at[row, cols], out_D, mask=cols_ok_D)


def _row_call(
    kernel, rows_inputs, weight_D, num_outputs: int, *, tiles: tuned.RowTiles | None, interpret: bool, name: str
):
    """Run `kernel` over the rows of [N, D] inputs (D a power of two), one program per row; tiles None:
    `tuned.ROWS`."""
    tiles = tiles or lookup(tuned.ROWS, dtype=rows_inputs[0].dtype)
    rows, dim = rows_inputs[0].shape
    row = pl.BlockSpec((None, dim), lambda i: (i, 0))
    out = jax.ShapeDtypeStruct((rows, dim), rows_inputs[0].dtype)
    return pl.pallas_call(
        kernel,
        grid=(rows,),
        in_specs=[row] * len(rows_inputs) + [pl.BlockSpec((dim,), lambda i: (0,))],
        out_specs=[row] * num_outputs,
        out_shape=[out] * num_outputs,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret,
        name=name,
    )(*rows_inputs, weight_D)


@functools.partial(jax.jit, static_argnames=("eps", "tiles", "interpret"))
def rms_norm_gpu(x, weight_D, *, eps: float, tiles: tuned.RowTiles | None = None, interpret: bool = False):
    """`rms_norm_reference` for x [..., D] with D a power of two."""
    (out,) = _row_call(
        functools.partial(_norm_kernel, eps=eps),
        [x.reshape(-1, x.shape[-1])],
        weight_D,
        1,
        tiles=tiles,
        interpret=interpret,
        name="rms_norm",
    )
    return out.reshape(x.shape)


@functools.partial(jax.jit, static_argnames=("eps", "tiles", "interpret"))
def add_rms_norm_gpu(
    x, residual, weight_D, *, eps: float, tiles: tuned.RowTiles | None = None, interpret: bool = False
):
    """`add_rms_norm_reference` for x, residual [..., D] with D a power of two."""
    flat = [a.reshape(-1, x.shape[-1]) for a in (x, residual)]
    total, out = _row_call(
        functools.partial(_add_norm_kernel, eps=eps),
        flat,
        weight_D,
        2,
        tiles=tiles,
        interpret=interpret,
        name="add_rms_norm",
    )
    return total.reshape(x.shape), out.reshape(x.shape)


@functools.partial(jax.jit, static_argnames=("eps", "tiles", "interpret"))
def add_partials_rms_norm_gpu(
    x, partials_SND, weight_D, *, eps: float, tiles: tuned.RowTiles | None = None, interpret: bool = False
):
    """`add_partials_rms_norm_reference` for x [..., D] (any D) and fp32 partial sums [S, N, D] (N: x's rows),
    added split 0 first, then 1, ... before the cast to x's dtype and the residual add; one program a row."""
    tiles = tiles or lookup(tuned.ROWS, dtype=x.dtype)
    x_ND = x.reshape(-1, x.shape[-1])
    whole = [pl.BlockSpec(a.shape, lambda i, n=a.ndim: (0,) * n) for a in (x_ND, partials_SND, weight_D)]
    total, out = pl.pallas_call(
        functools.partial(_add_partials_norm_kernel, eps=eps),
        grid=(x_ND.shape[0],),
        in_specs=whole,
        out_specs=[whole[0]] * 2,
        out_shape=[jax.ShapeDtypeStruct(x_ND.shape, x.dtype)] * 2,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret,
        name="add_partials_rms_norm",
    )(x_ND, partials_SND, weight_D)
    return total.reshape(x.shape), out.reshape(x.shape)
