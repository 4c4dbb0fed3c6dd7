"""The (I + L)^-1 of a KDA chunk on GPU (L strictly lower [64, 64], held as 16x16 blocks), in two stages, and the
WY factors it multiplies:

1. `unit_lower_inverse_16`, inside phase 1's block-row kernel: the inverse of one diagonal block, a row at a
   time in registers, no products. Row c of X = (I + L)^-1 is e_c - sum_{j<c} L[c, j] X[j, :]; the block is
   given transposed (U = L^T), so L's row c is U's column c: a masked sum along axis 1 gives it as a column
   (broadcast along rows, as X's rows need), and the update is a sum along axis 0, already a row: the 15-step
   chain has no tensor-core product and no layout conversion (only the sums' cross-thread exchanges), where
   forward substitution by masked 16x16 products converted layouts around each of its 15 products.
2. `wy_factors`, a pallas_call with grid (B*H, T/64): from the four diagonal inverses D_i and the blocks
   L_ij (j < i) below them, X_ii = D_i and X_ij = -D_i sum_{m=j}^{i-1} L_im X_mj, as 16x16 products held in
   registers, then the WY factors w = X kb and u = X (beta v) by 16-row blocks (X never goes to memory).
Every X block is a block of the true inverse (bounded for the delta rule's L: |entries| stay moderate even for
equal keys, where X is bidiagonal), so no intermediate grows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda import tuned
from pallas_kernels.kda.chunk_math import SUB, Dots
from pallas_kernels.tuning import lookup

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
    return Dots(
        nn=functools.partial(plgpu.dot, allow_tf32=allow_tf32),
        nt=functools.partial(plgpu.dot, trans_b=True, allow_tf32=allow_tf32),
        tn=functools.partial(plgpu.dot, trans_a=True, allow_tf32=allow_tf32),
    )


def merged_inverse(block, dots: Dots):
    """X = (I + L)^-1 of a chunk as 16x16 blocks X[i][j], j <= i, held in registers: block(i, j) gives D_i =
    (I + L_ii)^-1 for j = i and L_ij for j < i; X_ii = D_i, X_ij = -D_i sum_{m=j}^{i-1} L_im X_mj."""
    inverse = []
    for i in range(SUBS):
        diagonal = block(i, i)
        below = [
            -dots.nn(diagonal, functools.reduce(jnp.add, [dots.nn(block(i, m), inverse[m][j]) for m in range(j, i)]))
            for j in range(i)
        ]
        inverse.append(below + [diagonal])
    return inverse


def lower_product(inverse, i: int, rows_of, dots: Dots):
    """Sub-block i's rows of X times a chunk's rows: sum_{j<=i} X_ij rows_of(j), rows_of(j) sub-block j's fp32
    [SUB, W] rows (formed where used, so that few are alive at once)."""
    return functools.reduce(jnp.add, [dots.nn(inverse[i][j], rows_of(j)) for j in range(i + 1)])


def _merge_kernel(blocks_ref, kb_ref, v_ref, beta_ref, w_ref, u_ref, *, input_dtype, invert_diagonal):
    """blocks_ref [CHUNK, CHUNK]: D_i on the diagonal (with invert_diagonal: L_ii, inverted here from its
    transpose, its upper triangle ignored), L_ij below it (above: not read); kb_ref [CHUNK, K], v_ref [CHUNK, V],
    beta_ref [CHUNK, 1]. X's blocks stay in registers; the rows of w and u of sub-block i are sums over j <= i of
    X_ij times sub-block j's rows (re-read per i from L1/L2: four [SUB, K] fp32 tiles alive at once would crowd
    the registers)."""
    dots = gpu_dots(input_dtype)
    rows, cols = iota_16(0), iota_16(1)

    def block(i, j):
        stored = blocks_ref[sub_rows(i), sub_rows(j)]
        if i == j and invert_diagonal:
            return unit_lower_inverse_16(jnp.where(rows < cols, stored.T, 0.0))
        return stored

    inverse = merged_inverse(block, dots)
    for i in range(SUBS):
        w = lower_product(inverse, i, lambda j: kb_ref[sub_rows(j), :].astype(jnp.float32), dots)
        u = lower_product(
            inverse, i, lambda j: beta_ref[sub_rows(j), :] * v_ref[sub_rows(j), :].astype(jnp.float32), dots
        )
        w_ref[sub_rows(i), :] = w.astype(w_ref.dtype)
        u_ref[sub_rows(i), :] = u.astype(u_ref.dtype)


def wy_factors(
    blocks,
    kb,
    v,
    beta,
    *,
    parts_dtype,
    input_dtype,
    tiles: tuned.IntraTiles | None = None,
    invert_diagonal: bool = False,
    interpret: bool = False,
):
    """(w [BH, Tp, K], u [BH, Tp, V] in parts_dtype): w = X kb, u = X (beta v) per chunk, X = (I + L)^-1 merged
    from blocks [BH, Tp, CHUNK] fp32 (per chunk: the diagonal blocks' inverses D_i on the diagonal, or with
    invert_diagonal the diagonal blocks L_ii themselves, the blocks L_ij of L below it); kb [BH, Tp, K]
    (beta e^G k, in the parts' dtype), v [B, Tp, H, V], beta [B, Tp, H, 1] fp32; products as
    `gpu_dots(input_dtype)`. Grid (BH, Tp / CHUNK). Tiles (factors_num_warps, num_stages): None from
    `tuned.CHUNK_INTRA`."""
    tiles = tiles or lookup(tuned.CHUNK_INTRA, dtype=input_dtype)
    flat, padded, key_dim = kb.shape
    _, _, heads, value_dim = v.shape
    rows = lambda width: pl.BlockSpec((None, CHUNK, width), lambda bh, n: (bh, n, 0))  # noqa: E731
    heads_layout = lambda width: pl.BlockSpec(  # noqa: E731
        (None, CHUNK, None, width), lambda bh, n: (bh // heads, n, bh % heads, 0)
    )
    return pl.pallas_call(
        functools.partial(_merge_kernel, input_dtype=input_dtype, invert_diagonal=invert_diagonal),
        grid=(flat, padded // CHUNK),
        in_specs=[rows(CHUNK), rows(key_dim), heads_layout(value_dim), heads_layout(1)],
        out_specs=[rows(key_dim), rows(value_dim)],
        out_shape=[
            jax.ShapeDtypeStruct((flat, padded, key_dim), parts_dtype),
            jax.ShapeDtypeStruct((flat, padded, value_dim), parts_dtype),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=tiles.factors_num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="kda_prefill_intra_wy_factors" + ("_inverting" if invert_diagonal else ""),
    )(blocks, kb, v, beta)
