"""RMSNorm on GPU: one Pallas kernel (Triton lowering), optionally with the residual add in front.

Program = one row of D values held in registers: (residual add, stored), the fp32 mean of squares, the
normalised row rounded to the input dtype, times the weight in that dtype (computed exactly in fp32, then
rounded, which is what a bf16 multiply is). A decode step's norms are rows of 2,560 or 4,096: XLA runs each as a
reduction kernel plus an elementwise kernel (plus one for the add); this is one launch. Rows may have any width:
the program loads the next power of two of D values, the ones past D masked (Ling-3.0-flash's rows are 2,560 wide).

The added operand comes as [S, N, D] (N: x's rows): `add_partials_rms_norm_gpu` takes a split-K gemv's fp32
partial sums (`weight_only_gemv_partials_gpu`) and adds them first, split after split (a fixed order, whatever the
rows; no atomics), so the product's reduction needs no launch of its own; `add_rms_norm_gpu` passes its residual as
the one split of its own dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.norm import tuned
from pallas_kernels.tuning import lookup


def _normalise(total_D, weight_D, eps: float, dtype, dim: int):
    """The norm of one row, as `rms_norm_reference` computes it; dim: the row's width (total_D is zero past it)."""
    total_f32 = total_D.astype(jnp.float32)
    mean_square = jnp.sum(total_f32 * total_f32) / dim
    normed = (total_f32 * jax.lax.rsqrt(mean_square + eps)).astype(dtype)
    return (weight_D.astype(dtype).astype(jnp.float32) * normed.astype(jnp.float32)).astype(dtype)


def _row(dim: int):
    """(load, store) of this program's row of width `dim` at a ref's given leading indices (none: a 1-D ref), as the
    next power of two of values, masked past dim."""
    width = pl.next_power_of_2(dim)
    cols = pl.ds(0, width)
    cols_ok_D = jnp.arange(width) < dim if width != dim else None

    def load(ref, *at):
        return plgpu.load(ref.at[(*at, cols)], mask=cols_ok_D, other=None if cols_ok_D is None else 0.0)

    def store(ref, value_D, *at):
        plgpu.store(ref.at[(*at, cols)], value_D, mask=cols_ok_D)

    return load, store


def _norm_kernel(x_ref, weight_ref, out_ref, *, eps: float):
    dim, row = x_ref.shape[1], pl.program_id(0)
    load, store = _row(dim)
    store(out_ref, _normalise(load(x_ref, row), load(weight_ref), eps, out_ref.dtype, dim), row)


def _add_norm_kernel(x_ref, addends_ref, weight_ref, total_ref, out_ref, *, eps: float):
    """One row: x + (the addends [S, N, D] added in split order, cast to x's dtype), stored, and its norm."""
    dim, row = x_ref.shape[1], pl.program_id(0)
    load, store = _row(dim)
    y_D = load(addends_ref, jnp.int32(0), row)
    for split in range(1, addends_ref.shape[0]):
        y_D = y_D + load(addends_ref, jnp.int32(split), row)
    x_D = load(x_ref, row)
    total_D = (x_D.astype(jnp.float32) + y_D.astype(x_D.dtype).astype(jnp.float32)).astype(total_ref.dtype)
    store(total_ref, total_D, row)
    store(out_ref, _normalise(total_D, load(weight_ref), eps, out_ref.dtype, dim), row)


def _row_call(kernel, x, operands, weight_D, num_outputs: int, *, tiles, interpret: bool, name: str):
    """`kernel` over the rows of x [..., D] (any D), one program a row, with `operands` (whole arrays) and the weight;
    -> num_outputs arrays of x's shape and dtype. tiles None: `tuned.ROWS`."""
    tiles = tiles or lookup(tuned.ROWS, dtype=x.dtype)
    x_ND = x.reshape(-1, x.shape[-1])
    inputs = [x_ND, *operands, weight_D]
    whole = [pl.BlockSpec(a.shape, lambda i, n=a.ndim: (0,) * n) for a in inputs]
    outs = pl.pallas_call(
        kernel,
        grid=(x_ND.shape[0],),
        in_specs=whole,
        out_specs=[whole[0]] * num_outputs,
        out_shape=[jax.ShapeDtypeStruct(x_ND.shape, x.dtype)] * num_outputs,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret,
        name=name,
    )(*inputs)
    return tuple(out.reshape(x.shape) for out in outs)


@functools.partial(jax.jit, static_argnames=("eps", "tiles", "interpret"))
def rms_norm_gpu(x, weight_D, *, eps: float, tiles: tuned.RowTiles | None = None, interpret: bool = False):
    """`rms_norm_reference` for x [..., D] (any D)."""
    kernel = functools.partial(_norm_kernel, eps=eps)
    (out,) = _row_call(kernel, x, [], weight_D, 1, tiles=tiles, interpret=interpret, name="rms_norm")
    return out


@functools.partial(jax.jit, static_argnames=("eps", "tiles", "interpret"))
def add_rms_norm_gpu(
    x, residual, weight_D, *, eps: float, tiles: tuned.RowTiles | None = None, interpret: bool = False
):
    """`add_rms_norm_reference` for x, residual [..., D] (any D): the residual is the kernel's one addend."""
    addends_1ND = residual.reshape(1, -1, x.shape[-1])
    kernel = functools.partial(_add_norm_kernel, eps=eps)
    return _row_call(kernel, x, [addends_1ND], weight_D, 2, tiles=tiles, interpret=interpret, name="add_rms_norm")


@functools.partial(jax.jit, static_argnames=("eps", "tiles", "interpret"))
def add_partials_rms_norm_gpu(
    x, partials_SND, weight_D, *, eps: float, tiles: tuned.RowTiles | None = None, interpret: bool = False
):
    """`add_partials_rms_norm_reference` for x [..., D] (any D) and fp32 partial sums [S, N, D] (N: x's rows),
    added split 0 first, then 1, ... before the cast to x's dtype and the residual add; one program a row."""
    kernel = functools.partial(_add_norm_kernel, eps=eps)
    return _row_call(
        kernel, x, [partials_SND], weight_D, 2, tiles=tiles, interpret=interpret, name="add_partials_rms_norm"
    )
