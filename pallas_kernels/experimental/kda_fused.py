"""Lab variants of the KDA prefill on GPU: phase 1 with programs that own whole 64-token chunks (the variants
gpu_triton_fused, one kernel, and gpu_triton_fused_wy, two), for gates >= -5, phase 2 the default's.

Measured slower than the default gpu_triton on the H200 (17.92 and 13.82 ms against 7.59 at B=1 T=32768:
docs/benchmarks/kda.md, 'Fused phase-1 forms measured (2026-12-02, fifth session)'), so they live here: importing
this module registers both with `pallas_kernels.kda.ops.VARIANTS["chunk_kda"]` (bounded gates only, like
gpu_triton; their any-gate form is gpu_triton_any_gate). They reuse the default kernels' building blocks
(`kda.gpu_triton.blocks`, `tril`, `intra.ChunkParts`, `chunk.chunk_kda_gpu` with this phase 1).

Grid (B*H, T/64), the sequence-head fastest: program (bh, n) owns chunk n of sequence-head bh and forms every
product of the chunk as [64, 16] column blocks (products [64, block_k] x [block_k, 16], whose 64 rows spread over
the warps, where `blocks` ran [16, block_k] x [block_k, 16] products in a program per 16-row sub-block with loops
over the earlier sub-blocks, after a kernel storing their decayed keys). A first form of one program per chunk
doing the sub-blocks in turn with [16, block_k] tiles, the WY factors included, measured 3.2x slower than the
three kernels (docs/benchmarks/kda.md, issue 27): such products keep one warp busy, and the chain of 16-row steps
ran with little to overlap it.

Column block j (16 columns, sub-block j) uses the decay to its own last row as reference: with G the chunk's
cumulative log-decay (log2 units), R_j = G at row 16j + 15 and t_j sub-block j's total,
  e^{G_c - G_s} = 2^{G_c - R_j - S} 2^{(t_j - Γ_s) + S}   (rows c >= 16j; columns s of sub-block j),
Γ_s the cumulative log-decay inside sub-block j. The right factor, sub-block j's keys decayed to its end, comes
from its own 16 rows (loaded again; Γ and t_j are sums of its gates alone); the left one from the chunk's rows,
its exponent forced to -inf above sub-block j (so those rows of the column block are 0, and nothing overflows).
For gates >= -5 both exponents lie in [-115, 0] (16 gates); the shift e^S = 2^58 (a product by a power of two,
exact) keeps each factor within 2^{+-58} on the diagonal block, where fp32 can neither overflow nor lose a factor
to underflow; below it the left factor is <= 2^-58, and where it underflows the decay is below 2^-68 anyway. So
the kernels take gates >= -5 only (`chunk_math.GATE_FLOOR`; any-gate prefill: `gpu_triton_any_gate`). e^G and
the left factor are exponentials of G, a 64-row running sum (its fp32 rounding, ~ulp(|G|), enters the exponent:
~1e-6 relative at the gate bound, as in the jnp chunked form); kg = e^{G_last - G} k comes from sub-block j's
rows decayed to its end times the later totals, as in `blocks` (no difference of two 64-gate sums).

- One kernel (`_one_kernel`): the 16x16 blocks of L = diag(beta) A_kk are split out of the column blocks, the
  diagonal ones inverted by row updates (`tril.unit_lower_inverse_16`) and merged into X = (I + L)^-1
  (`tril.merged_inverse`), X is put together as one [64, 64] tile, and w = X (beta e^G k), u = X (beta v) are
  [64, 64] x [64, block_k] products. Nothing but `ChunkParts` goes to memory.
- Two kernels (`chunk_blocks`, then `tril.wy_factors` with invert_diagonal): the first stores what
  `blocks.decay_blocks` stores, except that the diagonal blocks of L are stored as they are (upper triangle
  unmasked), for the second to invert.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import variants
from pallas_kernels.kda import ops
from pallas_kernels.kda import tuned as kda_tuned
from pallas_kernels.kda.gpu_triton import ChunkParts, chunk_kda_gpu, wy_factors
from pallas_kernels.kda.gpu_triton.blocks import LOG2_E, SHIFT_DOWN, SHIFT_UP, inverse_norms, key_column_blocks
from pallas_kernels.kda.gpu_triton.tril import (
    CHUNK,
    SUB,
    SUBS,
    gpu_dots,
    iota_16,
    merged_inverse,
    sub_rows,
    unit_lower_inverse_16,
)
from pallas_kernels.tuning import lookup
from pallas_kernels.variants import Variant


@dataclasses.dataclass(frozen=True)
class FusedTiles:
    """gpu_triton_fused phase 1 (one kernel): key (and value) columns per step, Triton warps."""

    block_k: int
    num_warps: int


@dataclasses.dataclass(frozen=True)
class FusedWyTiles:
    """gpu_triton_fused_wy phase 1: key columns per step and warps of the chunk-wide products kernel, warps of the
    WY-factors kernel."""

    block_k: int
    num_warps: int
    factors_num_warps: int


CHUNK_FUSED = kda_tuned.h200_and_default(
    FusedTiles(block_k=32, num_warps=4),
    "not measured: 4 warps for the products' 64 rows (16 a warp); [64, 32] fp32 tiles (16 registers a thread) so "
    "that the G, q, k tiles and the eight [64, 16] accumulators stay under 255 registers (about 260 at block_k 64)",
)
CHUNK_FUSED_WY = kda_tuned.h200_and_default(
    FusedWyTiles(block_k=32, num_warps=4, factors_num_warps=2),
    "not measured: CHUNK_FUSED's settings for the products kernel; the WY factors as kda.tuned.CHUNK_INTRA's",
)


def _tiles(ref, columns_list, rows=slice(None)):
    return [ref[rows, columns].astype(jnp.float32) for columns in columns_list]


def _concat_columns(left, right):
    """[R, C] and [R, C] side by side as [R, 2C] (Triton joins only along a new last axis)."""
    return jnp.stack([left, right], axis=-1).transpose(0, 2, 1).reshape(left.shape[0], 2 * left.shape[1])


def _concat_rows(top, bottom):
    """[R, C] over [R, C] as [2R, C]."""
    return jnp.stack([top, bottom], axis=-1).transpose(2, 0, 1).reshape(2 * top.shape[0], top.shape[1])


def _concat(parts, concat):
    while len(parts) > 1:
        parts = [concat(a, b) for a, b in zip(parts[::2], parts[1::2])]
    return parts[0]


class _Chunk(NamedTuple):
    """What the passes over a chunk's key columns share: column blocks, [CHUNK, 1] fp32 scales and beta."""

    key_blocks: list
    query_scale: jax.Array
    key_scale: jax.Array
    beta: jax.Array

    def queries(self, q_ref, columns):
        return q_ref[:, columns].astype(jnp.float32) * self.query_scale

    def keys(self, k_ref, columns):
        return k_ref[:, columns].astype(jnp.float32) * self.key_scale


def _chunk(q_ref, k_ref, beta_ref, scale, l2norm, block_k) -> _Chunk:
    key_blocks = key_column_blocks(k_ref.shape[1], block_k)
    query_scale = inverse_norms(_tiles(q_ref, key_blocks), l2norm) * scale
    return _Chunk(key_blocks, query_scale, inverse_norms(_tiles(k_ref, key_blocks), l2norm), beta_ref[...])


def _products(chunk: _Chunk, q_ref, k_ref, g_ref, qg_ref, kg_ref, decay_ref, kb_ref, l2norm, dots):
    """Pass 1 over the key columns: stores qg, kg, e^{G_last} (and kb = beta e^G k when kb_ref is given);
    returns the [CHUNK, SUB] column blocks j of a_qk and A_kk (rows above sub-block j zero, the diagonal
    blocks unmasked)."""
    block_k = chunk.key_blocks[0].size
    sub_key_scales = [inverse_norms(_tiles(k_ref, chunk.key_blocks, sub_rows(j)), l2norm) for j in range(SUBS)]
    rows_CB = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, block_k), 0)
    zeros_CS = jnp.zeros((CHUNK, SUB), jnp.float32)
    a_qk, a_kk = [zeros_CS] * SUBS, [zeros_CS] * SUBS
    for columns in chunk.key_blocks:
        totals = [jnp.sum(g_ref[sub_rows(j), columns] * LOG2_E, axis=0, keepdims=True) for j in range(SUBS)]
        later = [sum(totals[j + 1 :], jnp.zeros_like(totals[0])) for j in range(SUBS)]  # t_{j+1} + ... + t_3
        log_decay = jnp.cumsum(g_ref[:, columns] * LOG2_E, axis=0)  # G
        queries, keys = chunk.queries(q_ref, columns), chunk.keys(k_ref, columns)
        decay = jnp.exp2(log_decay)  # e^G (an underflow to 0 is a decay below e^-87)
        qg_ref[:, columns] = (queries * decay).astype(qg_ref.dtype)
        if kb_ref is not None:
            kb_ref[:, columns] = (chunk.beta * keys * decay).astype(kb_ref.dtype)
        end = jnp.zeros((1, block_k), jnp.float32)
        for j in range(SUBS):  # one sub-block's right factor alive at a time
            gates = g_ref[sub_rows(j), columns] * LOG2_E
            keys_j = k_ref[sub_rows(j), columns].astype(jnp.float32) * sub_key_scales[j]
            right = keys_j * (jnp.exp2(totals[j] - jnp.cumsum(gates, axis=0)) * SHIFT_UP)  # k_s 2^{t_j - Γ_s + S}
            kg_ref[sub_rows(j), columns] = (right * (jnp.exp2(later[j]) * SHIFT_DOWN)).astype(kg_ref.dtype)
            end = end + totals[j]  # R_j
            left = jnp.exp2(jnp.where(rows_CB >= SUB * j, log_decay - end, -jnp.inf)) * SHIFT_DOWN
            a_qk[j] = a_qk[j] + dots.nt(queries * left, right)
            a_kk[j] = a_kk[j] + dots.nt(keys * left, right)
        decay_ref[:, columns] = jnp.exp2(end)  # e^{G_last}
    return a_qk, a_kk


def _store_a_qk(a_ref, a_qk):
    rows_CS = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, SUB), 0)
    cols_CS = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, SUB), 1)
    for j in range(SUBS):
        a_ref[:, sub_rows(j)] = jnp.where(rows_CS >= cols_CS + SUB * j, a_qk[j], 0.0).astype(a_ref.dtype)


def _kernel(
    q_ref,
    k_ref,
    g_ref,
    beta_ref,
    qg_ref,
    a_ref,
    blocks_ref,
    kb_ref,
    kg_ref,
    decay_ref,
    *,
    scale,
    l2norm,
    input_dtype,
    block_k,
):
    """`chunk_blocks`: chunk n's rows of every output (module docstring), block_k key columns at a time."""
    chunk = _chunk(q_ref, k_ref, beta_ref, scale, l2norm, block_k)
    a_qk, a_kk = _products(chunk, q_ref, k_ref, g_ref, qg_ref, kg_ref, decay_ref, kb_ref, l2norm, gpu_dots(input_dtype))
    _store_a_qk(a_ref, a_qk)
    for j in range(SUBS):
        blocks_ref[:, sub_rows(j)] = chunk.beta * a_kk[j]


def _one_kernel(
    q_ref,
    k_ref,
    g_ref,
    v_ref,
    beta_ref,
    w_ref,
    u_ref,
    qg_ref,
    kg_ref,
    a_ref,
    decay_ref,
    *,
    scale,
    l2norm,
    input_dtype,
    block_k,
):
    """`one_kernel_parts`: `_kernel`'s products, then X = (I + L)^-1 from its 16x16 blocks
    (split out of the column blocks, the diagonal ones inverted by row updates, `tril.merged_inverse`), put
    together as one [CHUNK, CHUNK] tile, and w = X kb, u = X (beta v) as [CHUNK, CHUNK] x [CHUNK, block_k]
    products (kb formed again from the inputs, block_k columns at a time)."""
    dots = gpu_dots(input_dtype)
    chunk = _chunk(q_ref, k_ref, beta_ref, scale, l2norm, block_k)
    a_qk, a_kk = _products(chunk, q_ref, k_ref, g_ref, qg_ref, kg_ref, decay_ref, None, l2norm, dots)
    _store_a_qk(a_ref, a_qk)
    below = [jnp.split(chunk.beta * column, SUBS, axis=0) for column in a_kk]  # below[j][i] = L_ij
    rows, cols = iota_16(0), iota_16(1)

    def block(i, j):
        return unit_lower_inverse_16(jnp.where(rows < cols, below[i][i].T, 0.0)) if i == j else below[j][i]

    inverse = merged_inverse(block, dots)
    zeros_SS = jnp.zeros((SUB, SUB), jnp.float32)
    columns_of_x = [
        _concat([inverse[i][j] if i >= j else zeros_SS for i in range(SUBS)], _concat_rows) for j in range(SUBS)
    ]
    x_CC = _concat(columns_of_x, _concat_columns)
    for columns in chunk.key_blocks:
        decay = jnp.exp2(jnp.cumsum(g_ref[:, columns] * LOG2_E, axis=0))
        kb = chunk.beta * chunk.keys(k_ref, columns) * decay
        w_ref[:, columns] = dots.nn(x_CC, kb).astype(w_ref.dtype)
    for columns in key_column_blocks(v_ref.shape[1], block_k):
        u_ref[:, columns] = dots.nn(x_CC, chunk.beta * v_ref[:, columns].astype(jnp.float32)).astype(u_ref.dtype)


class _Grid(NamedTuple):
    """Grid (B*H, N) over a chunk a program, the sequence-head fastest, and the block specs of its arrays."""

    heads: int
    flat: int
    padded: int
    num_chunks: int
    parts_dtype: object

    def inputs(self, width):  # [B, Tp, H, width]: chunk n of head bh
        heads = self.heads
        return pl.BlockSpec((None, CHUNK, None, width), lambda bh, n: (bh // heads, n, bh % heads, 0))

    def rows(self, width, dtype=None):  # output [BH, Tp, width], in the parts' dtype unless given
        shape = jax.ShapeDtypeStruct((self.flat, self.padded, width), dtype or self.parts_dtype)
        return pl.BlockSpec((None, CHUNK, width), lambda bh, n: (bh, n, 0)), shape

    def per_chunk(self, width):  # output [BH, N, 1, width] fp32
        shape = jax.ShapeDtypeStruct((self.flat, self.num_chunks, 1, width), jnp.float32)
        return pl.BlockSpec((None, None, 1, width), lambda bh, n: (bh, n, 0, 0)), shape


def _grid(q, parts_dtype) -> _Grid:
    batch, padded, heads, _ = q.shape
    return _Grid(heads, batch * heads, padded, padded // CHUNK, parts_dtype)


def _launch(kernel, grid: _Grid, name: str, in_specs, outputs, num_warps: int, interpret: bool):
    """pl.pallas_call over `grid` with outputs [(block spec, shape)]."""
    return pl.pallas_call(
        kernel,
        grid=(grid.flat, grid.num_chunks),  # axis 0 varies fastest
        in_specs=in_specs,
        out_specs=[spec for spec, _ in outputs],
        out_shape=[shape for _, shape in outputs],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=name,
    )


def chunk_blocks(
    q,
    k,
    g,
    beta,
    *,
    scale: float,
    use_qk_l2norm: bool,
    parts_dtype,
    tiles: FusedWyTiles | None = None,
    interpret: bool = False,
):
    """(qg [BH, Tp, K], a_qk [BH, Tp, CHUNK] in parts_dtype, blocks [BH, Tp, CHUNK] fp32: L by column blocks,
    its diagonal blocks not inverted and their upper triangles not masked, kb, kg [BH, Tp, K] in parts_dtype,
    decay_last [BH, N, 1, K] fp32) from q, k [B, Tp, H, K], g [B, Tp, H, K] fp32 (>= -5), beta [B, Tp, H, 1]
    fp32, Tp = N * CHUNK. Grid (B*H, N); block_k key columns at a time (a power of two). Tiles: None from
    `CHUNK_FUSED_WY`."""
    tiles = tiles or lookup(CHUNK_FUSED_WY, dtype=q.dtype)
    grid, key_dim = _grid(q, parts_dtype), q.shape[-1]
    kernel = functools.partial(
        _kernel, scale=scale, l2norm=use_qk_l2norm, input_dtype=q.dtype, block_k=min(tiles.block_k, key_dim)
    )
    keys_out = grid.rows(key_dim)
    outputs = [keys_out, grid.rows(CHUNK), grid.rows(CHUNK, jnp.float32), keys_out, keys_out, grid.per_chunk(key_dim)]
    in_specs = [grid.inputs(key_dim)] * 3 + [grid.inputs(1)]
    launch = _launch(kernel, grid, "kda_prefill_fused_blocks", in_specs, outputs, tiles.num_warps, interpret)
    return launch(q, k, g, beta)


def one_kernel_parts(q, k, v, g, beta, *, scale, use_qk_l2norm, parts_dtype, tiles: FusedTiles, interpret):
    """(w, u, qg, kg, a_qk, decay_last): `ChunkParts` from one pallas_call (`_one_kernel`), inputs and grid as
    `chunk_blocks`'."""
    grid, key_dim, value_dim = _grid(q, parts_dtype), q.shape[-1], v.shape[-1]
    kernel = functools.partial(
        _one_kernel,
        scale=scale,
        l2norm=use_qk_l2norm,
        input_dtype=v.dtype,
        block_k=min(tiles.block_k, key_dim, value_dim),
    )
    keys_out = grid.rows(key_dim)
    outputs = [keys_out, grid.rows(value_dim), keys_out, keys_out, grid.rows(CHUNK), grid.per_chunk(key_dim)]
    in_specs = [grid.inputs(key_dim)] * 3 + [grid.inputs(value_dim), grid.inputs(1)]
    launch = _launch(kernel, grid, "kda_prefill_fused_intra", in_specs, outputs, tiles.num_warps, interpret)
    return launch(q, k, g, v, beta)


_PHASE1_STATICS = ("scale", "use_qk_l2norm", "parts_dtype", "tiles", "interpret")


@functools.partial(jax.jit, static_argnames=_PHASE1_STATICS)
def fused_intra_chunk(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale: float,
    use_qk_l2norm=True,
    parts_dtype=None,
    tiles: FusedTiles | None = None,
    interpret=False,
) -> ChunkParts:
    """Phase 1 in one pallas_call (`intra.intra_chunk`'s signature and output, gates >= -5). Tiles: None from
    `CHUNK_FUSED`."""
    dtype = v.dtype if parts_dtype is None else parts_dtype
    tiles = tiles or lookup(CHUNK_FUSED, dtype=v.dtype)
    parts = one_kernel_parts(
        q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, parts_dtype=dtype, tiles=tiles, interpret=interpret
    )
    return ChunkParts(*parts)


@functools.partial(jax.jit, static_argnames=_PHASE1_STATICS)
def fused_wy_intra_chunk(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale: float,
    use_qk_l2norm=True,
    parts_dtype=None,
    tiles: FusedWyTiles | None = None,
    interpret=False,
) -> ChunkParts:
    """Phase 1 in two pallas_calls: `chunk_blocks`, then `tril.wy_factors` inverting the diagonal blocks (its
    stages as `kda.tuned.CHUNK_INTRA`'s). Tiles: None from `CHUNK_FUSED_WY`."""
    dtype = v.dtype if parts_dtype is None else parts_dtype
    tiles = tiles or lookup(CHUNK_FUSED_WY, dtype=v.dtype)
    qg, a_qk, blocks, kb, kg, decay_last = chunk_blocks(
        q, k, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, parts_dtype=dtype, tiles=tiles, interpret=interpret
    )
    factors_tiles = dataclasses.replace(
        lookup(kda_tuned.CHUNK_INTRA, dtype=v.dtype), factors_num_warps=tiles.factors_num_warps
    )
    w, u = wy_factors(
        blocks,
        kb,
        v,
        beta,
        parts_dtype=dtype,
        input_dtype=v.dtype,
        tiles=factors_tiles,
        invert_diagonal=True,
        interpret=interpret,
    )
    return ChunkParts(w, u, qg, kg, a_qk, decay_last)


# `chunk_kda_gpu` with these phase 1s: its keywords, tiles.intra a FusedTiles / FusedWyTiles
chunk_kda_gpu_fused = functools.partial(chunk_kda_gpu, phase1=fused_intra_chunk)
chunk_kda_gpu_fused_wy = functools.partial(chunk_kda_gpu, phase1=fused_wy_intra_chunk)

variants.register(
    ops.VARIANTS, "chunk_kda", "gpu_triton_fused", Variant("gpu", chunk_kda_gpu_fused, takes=ops.gate_is_bounded)
)
variants.register(
    ops.VARIANTS, "chunk_kda", "gpu_triton_fused_wy", Variant("gpu", chunk_kda_gpu_fused_wy, takes=ops.gate_is_bounded)
)
