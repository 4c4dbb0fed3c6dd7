"""The (I + L)^-1 of a KDA chunk on GPU (L strictly lower [64, 64], held as 16x16 blocks), in two stages:

1. `unit_lower_inverse_16`, inside phase 1's block-row kernel: the inverse of one diagonal block, a row at a
   time in registers, no products. Row c of X = (I + L)^-1 is e_c - sum_{j<c} L[c, j] X[j, :]; the block is
   given transposed (U = L^T), so L's row c is U's column c: a masked sum along axis 1 gives it as a column
   (broadcast along rows, as X's rows need), and the update is a sum along axis 0, already a row: the 15-step
   chain has no tensor-core product and no layout conversion (only the sums' cross-thread exchanges), where
   forward substitution by masked 16x16 products converted layouts around each of its 15 products.
2. `merge_inverse`, a pallas_call with grid (B*H, T/64): from the four diagonal inverses D_i and the blocks
   L_ij (j < i) below them, X_ii = D_i and X_ij = -D_i sum_{m=j}^{i-1} L_im X_mj, as 16x16 products;
   stores X's blocks on and below the diagonal in a [64, 64] fp32 matrix (the blocks above are left unwritten:
   w / u's products load it through `block_lower_mask`, as zeros there, and move 6 fewer blocks each way).
Every X block is a block of the true inverse (bounded for the delta rule's L: |entries| stay moderate even for
equal keys, where X is bidiagonal), so no intermediate grows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda.chunk_math import SUB, Dots

CHUNK = 64
SUBS = CHUNK // SUB  # sub-blocks per chunk


def iota_16(axis: int):
    return jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), axis)


def sub_rows(i):
    """Rows (or columns) of sub-block i (a Python or traced int)."""
    return pl.ds(i * SUB, SUB)


def unit_lower_inverse_16(strict_U):
    """(I + L)^-1 for L = strict_U^T, strict_U [SUB, SUB] strictly upper-triangular fp32, by row updates on
    register values (fp32 FMAs: exact for fp32 inputs, whatever the dot precision)."""
    rows, cols = iota_16(0), iota_16(1)
    inverse = (rows == cols).astype(jnp.float32)
    for c in range(1, SUB):
        L_row_c = jnp.sum(jnp.where(cols == c, strict_U, 0.0), axis=1, keepdims=True)  # [SUB, 1]: L[c, j] at j
        update = jnp.sum(L_row_c * inverse, axis=0, keepdims=True)  # [1, SUB]: sum_j L[c, j] X[j, :]
        inverse = inverse - jnp.where(rows == c, update, 0.0)
    return inverse


def gpu_dots(input_dtype) -> Dots:
    """Tensor-core products for a kernel whose inputs came as `input_dtype`: fp32 operands in tf32 when that is
    bf16/fp16 (whose own rounding is larger), IEEE fp32 for fp32 inputs; 16-bit operands at their own precision."""
    allow_tf32 = input_dtype != jnp.float32
    return Dots(nn=functools.partial(plgpu.dot, allow_tf32=allow_tf32),
                nt=functools.partial(plgpu.dot, trans_b=True, allow_tf32=allow_tf32),
                tn=functools.partial(plgpu.dot, trans_a=True, allow_tf32=allow_tf32))


def _merge_kernel(blocks_ref, inverse_ref, *, input_dtype):
    """blocks_ref [CHUNK, CHUNK]: D_i on the diagonal, L_ij below it (above: not read)."""
    dots = gpu_dots(input_dtype)
    block = lambda i, j: blocks_ref[sub_rows(i), sub_rows(j)]  # noqa: E731
    inverse = []
    for i in range(SUBS):
        diagonal = block(i, i)
        below = [-dots.nn(diagonal, functools.reduce(
            jnp.add, [dots.nn(block(i, m), inverse[m][j]) for m in range(j, i)])) for j in range(i)]
        inverse.append(below + [diagonal])
    for i in range(SUBS):
        for j in range(i + 1):
            inverse_ref[sub_rows(i), sub_rows(j)] = inverse[i][j]


def block_lower_mask():
    """[CHUNK, CHUNK] bool: the 16x16 blocks on and below the diagonal (those `merge_inverse` writes)."""
    rows = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0) // SUB
    return rows >= jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1) // SUB


def merge_inverse(blocks, *, input_dtype, num_warps: int = 2, num_stages: int = 1, interpret: bool = False):
    """(I + L)^-1 [BH, Tp, CHUNK] fp32 per chunk (its 16x16 blocks above the diagonal unwritten) from blocks
    [BH, Tp, CHUNK] fp32 (per chunk: the diagonal blocks' inverses D_i on the diagonal, the blocks L_ij of L
    below it); products as `gpu_dots(input_dtype)`.
    Grid (BH, Tp / CHUNK)."""
    flat, padded, _ = blocks.shape
    chunk = pl.BlockSpec((None, CHUNK, CHUNK), lambda bh, n: (bh, n, 0))
    return pl.pallas_call(
        functools.partial(_merge_kernel, input_dtype=input_dtype),
        grid=(flat, padded // CHUNK),
        in_specs=[chunk],
        out_specs=chunk,
        out_shape=jax.ShapeDtypeStruct(blocks.shape, jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_prefill_intra_inverse",
    )(blocks)
