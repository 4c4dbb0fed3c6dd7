"""RMSNorm on GPU: one Pallas kernel (Triton lowering), optionally with the residual add in front.

Program = one row of D values held in registers: (residual add, stored), the fp32 mean of squares, the
normalised row rounded to the input dtype, times the weight in that dtype (computed exactly in fp32, then
rounded, which is what a bf16 multiply is). A decode step's norms are rows of 4096: XLA runs each as a
reduction kernel plus an elementwise kernel (plus one for the add); this is one launch.

`add_partials_rms_norm_gpu` takes, in place of the product in front, its fp32 partial sums [S, N, D] (a split-K
gemv's, `weight_only_gemv_partials_gpu`) and adds them first, split after split (a fixed order, whatever the rows;
no atomics), so the product's reduction needs no launch of its own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.norm import tuned
from pallas_kernels.tuning import lookup


def _normalise(total_D, weight_D, eps: float, dtype):
    """The norm of one row, as `rms_norm_reference` computes it."""
    total_f32 = total_D.astype(jnp.float32)
    mean_square = jnp.sum(total_f32 * total_f32) / total_D.shape[0]
    normed = (total_f32 * jax.lax.rsqrt(mean_square + eps)).astype(dtype)
    return (weight_D.astype(dtype).astype(jnp.float32) * normed.astype(jnp.float32)).astype(dtype)


def _norm_kernel(x_ref, weight_ref, out_ref, *, eps: float):
    out_ref[...] = _normalise(x_ref[...], weight_ref[...], eps, out_ref.dtype)


def _add_norm_kernel(x_ref, residual_ref, weight_ref, total_ref, out_ref, *, eps: float):
    _add_norm(x_ref[...], residual_ref[...], weight_ref, total_ref, out_ref, eps=eps)


def _add_norm(x_D, residual_D, weight_ref, total_ref, out_ref, *, eps: float):
    """Store x + residual (the residual cast to x's dtype first) and its norm."""
    total = x_D.astype(jnp.float32) + residual_D.astype(x_D.dtype).astype(jnp.float32)
    total = total.astype(total_ref.dtype)
    total_ref[...] = total
    out_ref[...] = _normalise(total, weight_ref[...], eps, out_ref.dtype)


def _add_partials_norm_kernel(x_ref, partials_ref, weight_ref, total_ref, out_ref, *, eps: float):
    y_D = partials_ref[0, :]
    for split in range(1, partials_ref.shape[0]):
        y_D = y_D + partials_ref[split, :]
    _add_norm(x_ref[...], y_D.astype(x_ref.dtype), weight_ref, total_ref, out_ref, eps=eps)


def _row_call(
    kernel, rows_inputs, weight_D, num_outputs: int, *, tiles: tuned.RowTiles | None, interpret: bool, name: str
):
    """Run `kernel` over the rows of [N, D] inputs (D a power of two; an input [S, N, D]: its S rows of each), one
    program per row; the outputs [N, D] in the first input's dtype; tiles None: `tuned.ROWS`."""
    tiles = tiles or lookup(tuned.ROWS, dtype=rows_inputs[0].dtype)
    rows, dim = rows_inputs[0].shape
    row = pl.BlockSpec((None, dim), lambda i: (i, 0))
    stacked = {3: lambda a: pl.BlockSpec((a.shape[0], None, dim), lambda i: (0, i, 0)), 2: lambda a: row}
    out = jax.ShapeDtypeStruct((rows, dim), rows_inputs[0].dtype)
    return pl.pallas_call(
        kernel,
        grid=(rows,),
        in_specs=[stacked[a.ndim](a) for a in rows_inputs] + [pl.BlockSpec((dim,), lambda i: (0,))],
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
    """`add_partials_rms_norm_reference` for x [..., D] (D a power of two) and fp32 partial sums [S, N, D] (N: x's
    rows), added split 0 first, then 1, ... before the cast to x's dtype and the residual add."""
    total, out = _row_call(
        functools.partial(_add_partials_norm_kernel, eps=eps),
        [x.reshape(-1, x.shape[-1]), partials_SND],
        weight_D,
        2,
        tiles=tiles,
        interpret=interpret,
        name="add_partials_rms_norm",
    )
    return total.reshape(x.shape), out.reshape(x.shape)
