"""The absorbed-MLA weight products for a few query rows on GPU: two Pallas kernels (Triton lowering).

With one decode token per sequence each head's product is a vector times a [128, 512] slice of kv_b_proj.
XLA rewrites such a dot into a multiply and a reduction through a materialised, transposed fp32 copy of the
slice ([H, 512, 128], 17 MB written and read per product at Ling-3.1-flash size); these kernels read each
weight tile once, straight from kv_b_proj's [H, nope + v, R] view (the slices are block offsets), and
reduce in registers. Rows are few (up to ROWS), so products are elementwise multiply-and-sum, no dots.
The weight is read as stored (`moe.gpu_triton.weight_tiles`): dense, or block FP8 values with their scales split
per head, each tile dequantised on chip to the model's dtype (what `dequantized` would have written whole, a
[H x (nope + v), R] copy every step) and reduced in fp32.

- `absorb_query_gpu`, program (head, latent column tile): q_latent[m, h, cols] = sum_n q_nope[m, h, n] W_UK[h, n, cols].
- `expand_output_gpu`, program (head, value column tile): o[m, h, cols] = sum_r o_latent[m, h, r] W_UV[h, cols, r].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.fp8.reference import is_quantized
from pallas_kernels.mla import tuned
from pallas_kernels.moe.gpu_triton.weight_tiles import expert_tiles, kernel_operands, weight_format
from pallas_kernels.tuning import lookup

ROWS = 8  # the most query rows (batch x tokens) these kernels take


def _rows_of(vector_ref, rows: int):
    """One head's vectors, row by row, in fp32 (a Python list: Triton values cannot be sliced)."""
    return [vector_ref[row, :].astype(jnp.float32) for row in range(rows)]


def _stack_rows(row_values, rows: int, cols: int):
    """[rows, cols] from a list of [cols] values."""
    row_R1 = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    out = jnp.zeros((rows, cols), jnp.float32)
    for row, value in enumerate(row_values):
        out = jnp.where(row_R1 == row, value[None, :], out)
    return out


def _absorb_kernel(q_ref, *refs, rows: int, weight_format, nope: int, block: int, dtype):
    *weight_refs, out_ref = refs
    (weight,) = expert_tiles(weight_refs, [weight_format])
    col0 = pl.program_id(1) * block
    w_NC = weight.load(  # [nope, block] of W_UK
        pl.program_id(0), 0, col0, block_n=nope, block_k=block, cols_ok_N=None, k_ok_K=None, dtype=dtype
    ).astype(jnp.float32)
    products = [jnp.sum(q_N[:, None] * w_NC, axis=0) for q_N in _rows_of(q_ref, rows)]
    out_ref[...] = _stack_rows(products, rows, block)


def _expand_kernel(o_ref, *refs, rows: int, weight_format, nope: int, block: int, dtype):
    *weight_refs, out_ref = refs
    (weight,) = expert_tiles(weight_refs, [weight_format])
    rank = weight.shape[2]
    row0 = nope + pl.program_id(1) * block
    w_CR = weight.load(  # [block, R] of W_UV
        pl.program_id(0), row0, 0, block_n=block, block_k=rank, cols_ok_N=None, k_ok_K=None, dtype=dtype
    ).astype(jnp.float32)
    products = [jnp.sum(w_CR * o_R[None, :], axis=1) for o_R in _rows_of(o_ref, rows)]
    out_ref[...] = _stack_rows(products, rows, block)


def _column_block(wanted: int, *widths: int) -> int:
    """The largest power of two <= wanted dividing every width (Triton blocks are powers of two)."""
    block = wanted
    while any(width % block for width in widths):
        block //= 2
    return block


def kv_b_dtype(kv_b_HCR, dtype):
    """The dtype kv_b's products read it in: a dense weight's own, a quantised one's `dtype` (required)."""
    if not is_quantized(kv_b_HCR):
        return kv_b_HCR.dtype
    if dtype is None:
        raise ValueError("a quantised kv_b_proj needs dtype, the model dtype its tiles are dequantised to")
    return dtype


def _per_head_call(
    kernel, vectors_MHX, kv_b_HCR, out_width: int, block: int, *, nope: int, dtype, num_warps: int, interpret, name
):
    """Grid (head, output column tile): each program gets its head's M vectors (rows padded to a power of two)
    and reads its tile of kv_b [H, nope + v, R] (dense or quantised, `weight_tiles`); the result
    [M, H, out_width] fp32."""
    rows = pl.next_power_of_2(vectors_MHX.shape[0])
    if vectors_MHX.shape[0] > ROWS:
        raise ValueError(f"{vectors_MHX.shape[0]} query rows: these kernels take at most {ROWS}")
    padded_MHX = jnp.pad(vectors_MHX, ((0, rows - vectors_MHX.shape[0]), (0, 0), (0, 0)))
    heads, width = padded_MHX.shape[1:]
    stored = weight_format(kv_b_HCR, "kv_b_proj")
    operands = kernel_operands(kv_b_HCR, stored, name="kv_b_proj")
    whole = lambda array: pl.BlockSpec(array.shape, lambda h, c: (0,) * array.ndim)  # noqa: E731
    out = pl.pallas_call(
        functools.partial(kernel, rows=rows, weight_format=stored, nope=nope, block=block, dtype=dtype),
        grid=(heads, out_width // block),
        in_specs=[pl.BlockSpec((rows, None, width), lambda h, c: (0, h, 0)), *map(whole, operands)],
        out_specs=pl.BlockSpec((rows, None, block), lambda h, c: (0, h, c)),
        out_shape=jax.ShapeDtypeStruct((rows, heads, out_width), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name=name,
    )(padded_MHX, *operands)
    return out[: vectors_MHX.shape[0]]


@functools.partial(jax.jit, static_argnames=("dtype", "tiles", "interpret"))
def absorb_query_gpu(
    q_nope_MHN, kv_b_HCR, *, dtype=None, tiles: tuned.AbsorbTiles | None = None, interpret: bool = False
):
    """`absorb_query_reference` for at most ROWS rows: [M, H, R] fp32. kv_b: an array, or a quantised weight
    [H, nope + v, R] (scales split per head) dequantised tile by tile to `dtype`. Tiles: None from
    `tuned.ABSORB_QUERY`."""
    dtype = kv_b_dtype(kv_b_HCR, dtype)
    tiles = tiles or lookup(tuned.ABSORB_QUERY, dtype=dtype)
    nope, rank = q_nope_MHN.shape[2], kv_b_HCR.shape[2]
    block = _column_block(tiles.block, rank)
    return _per_head_call(
        _absorb_kernel,
        q_nope_MHN,
        kv_b_HCR,
        rank,
        block,
        nope=nope,
        dtype=dtype,
        num_warps=tiles.num_warps,
        interpret=interpret,
        name="mla_absorb_query",
    )


@functools.partial(jax.jit, static_argnames=("nope", "dtype", "tiles", "interpret"))
def expand_output_gpu(
    o_latent_MHR, kv_b_HCR, *, nope: int, dtype=None, tiles: tuned.AbsorbTiles | None = None, interpret: bool = False
):
    """`expand_output_reference` for at most ROWS rows: [M, H, V] fp32; kv_b and dtype as for `absorb_query_gpu`.
    Tiles: None from `tuned.EXPAND_OUTPUT`."""
    dtype = kv_b_dtype(kv_b_HCR, dtype)
    tiles = tiles or lookup(tuned.EXPAND_OUTPUT, dtype=dtype)
    value = kv_b_HCR.shape[1] - nope
    block = _column_block(tiles.block, nope, value)
    return _per_head_call(
        _expand_kernel,
        o_latent_MHR,
        kv_b_HCR,
        value,
        block,
        nope=nope,
        dtype=dtype,
        num_warps=tiles.num_warps,
        interpret=interpret,
        name="mla_expand_output",
    )
