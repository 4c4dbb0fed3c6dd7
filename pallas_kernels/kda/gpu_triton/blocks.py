"""KDA prefill on GPU, phase 1, kernels 1 and 2 of 3: the decay-weighted q-k and k-k products of a chunk, by rows
of 16x16 blocks, and the decayed keys (Pallas, Triton lowering).

`sub_block_keys`, grid (B*H, T/16): each 16-row sub-block's keys decayed to its end and its gate totals, formed
once for the later sub-blocks' programs of `decay_blocks` to load (rather than each of them forming them again:
norms, scans and exponentials per pair of sub-blocks).

`decay_blocks`, grid (B*H, T/64, 4): program (bh, n, i) owns sub-block i (16 rows) of chunk n, so every program is
short (rather than one program per chunk doing its sub-blocks in turn). The sequence-head is the fastest-varying
grid axis (Triton's x), not the sub-block (which would put a chunk's 4 programs side by side, sharing its keys
and gates in L2). The forms measured and their times: docs/benchmarks (KDA prefill).

With Γ_j the cumulative log-decay inside sub-block j (<= 0, log2 units for exp2) and t_j its total, for row c
of sub-block i and row s of sub-block j <= i the chunk-local decay is
  e^{G_c - G_s} = e^{Γ_c + S} e^{(t_j - Γ_s) + gap_j - S},   gap_j = t_{j+1} + ... + t_{i-1} (j < i),
  e^{G_c - G_s} = e^{Γ_c + S} e^{-Γ_s - S}                   (j = i, the diagonal block),
with the fixed shift e^S = 2^58 (S ~ 40): for gates >= -5, Γ >= -80 over 16 steps, so the diagonal block's
factors both lie in [e^-40, e^40] and fp32 can neither overflow nor lose a factor to underflow (e^{Γ_c} alone,
down to e^-80, times a small key component went subnormal: 4e-4 off on the diagonal blocks at K = 64). Below
the diagonal the second factor is <= e^-S; where it underflows the product is below e^-80 anyway. The shift
multiplies an exp2 by a power of two (exact), rather than entering its argument (which would round a slow
decay's small exponent to the ulp of ~58).
The program walks j = i-1 down to 0 (loading k_s e^{t_j - Γ_s} and t_j from `sub_block_keys`), carrying gap_j,
then sums the totals t_j of the later sub-blocks j > i, both as loops whose trip counts come from the program
id (straight-line code predicated on j < i, one branch per sub-block index, one program per chunk over
[4, 16, block_k] tiles and a masked sum of the later totals were measured slower or no faster). Its own rows are
loaded with an L2 evict-first hint, the earlier sub-blocks' keys and totals (which the later sub-blocks' programs
read again) evict-last. It stores
  qg rows of sub-block i: q_c e^{G_c} = q_c e^{Γ_c + S} e^{o_i - S}, o_i = t_0 + ... + t_{i-1} (parts dtype);
  a_qk rows of sub-block i: q_c k_s e^{G_c - G_s} for s <= c, zeros right of the diagonal (parts dtype);
  blocks rows of sub-block i (fp32): L_ij = diag(beta_i) (k_i k_j decay products) for j < i, and on the
  diagonal D_i = (I + L_ii)^-1, inverted in registers (`tril.unit_lower_inverse_16`) from L_ii^T,
  formed directly by one more 16x16 product (no transpose). Right of the diagonal: not written;
  kb rows of sub-block i: beta_c e^{G_c} k_c, as qg (the right factor of w = X kb; parts dtype);
  kg rows of sub-block i: e^{G_last - G_c} k_c = k_c e^{(t_i - Γ_c) + t_{i+1} + ... + t_3} (parts dtype; every
  exponent <= 0, and G_last - G_c is not the difference of two sums of up to 64 gates, whose fp32 rounding,
  ~|G_last| ulp, made kg 1e-4-wrong);
  decay_last (sub-block 3's program): e^{G_last} = e^{o_3 + t_3} (fp32).

Gates of any size (`any_gate`, the variant gpu_triton_any_gate): below -5 the diagonal block's e^{-Γ_s - S}
overflows (NaN from 16 gates of -6) and e^{Γ_c} alone underflows before the shift (2^-126, flushed to 0 on the
GPU: 20% off at a constant -5.5). So the diagonal block is formed from running products of per-step decays
instead (`exact_decay.pair_products`, no factor above 1; its k-k products come as L_ii, transposed once for the
inverse), and t_j - Γ_s (in the keys kernel and kg) as the sum
of the later gates alone (`exact_decay.suffix_sums`; the difference of two sums near -1000 would carry ~1e-4
of rounding into the exponent). Everything else holds for any gate: off the diagonal every factor is <= 1 or
the shift's 2^58 times one, and a factor that underflows to 0 (e^{Γ_c} below 2^-126 among them) stands for a
product below e^-87, which is 0 to fp32 next to the terms that count.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda import tuned
from pallas_kernels.kda.exact_decay import pair_products, suffix_sums
from pallas_kernels.kda.gpu_triton.tril import CHUNK, SUB, SUBS, gpu_dots, iota_16, sub_rows, unit_lower_inverse_16
from pallas_kernels.kda.reference import L2_EPS
from pallas_kernels.tuning import lookup

LOG2_E = 1.4426950408889634
SHIFT_UP, SHIFT_DOWN = 2.0**58, 2.0**-58  # ~e^{±40}: half the widest decay across a sub-block (16 gates >= -5)
EXACT_DOT = functools.partial(plgpu.dot, allow_tf32=False)  # IEEE fp32: sums of gates through a 0/1 matrix


def key_column_blocks(key_dim: int, block_k: int):
    """The key columns, block_k at a time."""
    return [pl.ds(c * block_k, block_k) for c in range(key_dim // block_k)]


def _rows(ref, column_blocks, eviction_policy=None):
    """ref's [SUB, K] rows as fp32 [SUB, block_k] tiles, one per column block."""
    return [
        plgpu.load(ref.at[:, columns], eviction_policy=eviction_policy).astype(jnp.float32) for columns in column_blocks
    ]


def inverse_norms(tiles, l2norm: bool):
    """[rows, 1] fp32: 1 / |x| (l2, with the reference's epsilon) of rows given as column-block tiles; ones
    without l2norm."""
    if not l2norm:
        return jnp.ones((tiles[0].shape[0], 1), jnp.float32)
    squares = [jnp.sum(jnp.square(tile), axis=1, keepdims=True) for tile in tiles]
    return jax.lax.rsqrt(functools.reduce(jnp.add, squares) + L2_EPS)


def as_row(column_SUB1):
    """A [SUB, 1] column as a [1, SUB] row, through a diagonal mask and a sum (no layout conversion)."""
    return jnp.sum(jnp.where(iota_16(0) == iota_16(1), column_SUB1, 0.0), axis=0, keepdims=True)


def _keys_kernel(k_ref, g_ref, right_ref, totals_ref, *, l2norm, block_k, any_gate):
    """One sub-block j: its keys decayed to its end, k_s e^{t_j - Γ_s} (<= 1), and its gate totals t_j."""
    column_blocks = key_column_blocks(k_ref.shape[1], block_k)
    keys = _rows(k_ref, column_blocks)
    key_scale_SUB1 = inverse_norms(keys, l2norm)
    for columns, key in zip(column_blocks, keys):
        g_j = g_ref[:, columns] * LOG2_E
        total = jnp.sum(g_j, axis=0, keepdims=True)
        to_end = suffix_sums(g_j, EXACT_DOT) if any_gate else total - jnp.cumsum(g_j, axis=0)  # t_j - Γ_s
        right_ref[:, columns] = (key * key_scale_SUB1 * jnp.exp2(to_end)).astype(right_ref.dtype)
        totals_ref[:, columns] = total


def _shifted_diagonal(decayed, dots):
    """(a_qk, A^T) of sub-block i against itself, A = the k-k decay products, from its rows' factors
    e^{Γ_c + S} (`decayed`) and e^{-Γ_s - S}: gates >= -5 only (e^{-Γ_s} up to e^80). Not masked."""
    a_qk, transposed = jnp.zeros((SUB, SUB), jnp.float32), jnp.zeros((SUB, SUB), jnp.float32)
    for q_left, k_left, keys, log_decay, *_ in decayed:
        right = keys * (jnp.exp2(-log_decay) * SHIFT_DOWN)  # e^{-Γ_s - S}
        a_qk, transposed = a_qk + dots.nt(q_left, right), transposed + dots.nt(right, k_left)
    return a_qk, transposed


def _exact_diagonal(g_ref, column_blocks, queries, keys):
    """(a_qk, A^T) of sub-block i against itself for gates of any size (`exact_decay.pair_products`): queries,
    keys its scaled queries and normalised keys [SUB, block_k] per column block. Zero above a_qk's diagonal."""
    a_qk, products = jnp.zeros((SUB, SUB), jnp.float32), jnp.zeros((SUB, SUB), jnp.float32)
    for columns, query, key in zip(column_blocks, queries, keys):
        step_decay = jnp.exp2(plgpu.load(g_ref.at[:, columns]) * LOG2_E)
        a_qk_part, products_part = pair_products([query, key], key, step_decay)
        a_qk, products = a_qk + a_qk_part, products + products_part
    return a_qk, products.T


def _kernel(
    q_ref,
    k_ref,
    g_ref,
    beta_ref,
    right_ref,
    totals_ref,
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
    any_gate,
):
    """Sub-block i's rows of every output (right_ref: the whole chunk's decayed keys, totals_ref [SUBS, K] its
    sub-blocks' gate totals, from `_keys_kernel`; the other refs: sub-block i's rows). Everything by column
    blocks of block_k keys, products summed over them: small fp32 tiles ([SUB, block_k])."""
    dots = gpu_dots(input_dtype)
    i = pl.program_id(2)
    rows, cols = iota_16(0), iota_16(1)
    zeros_SUBSUB = jnp.zeros((SUB, SUB), jnp.float32)
    column_blocks = key_column_blocks(k_ref.shape[1], block_k)
    queries, keys_i = _rows(q_ref, column_blocks, "evict_first"), _rows(k_ref, column_blocks, "evict_first")
    query_scale_SUB1 = inverse_norms(queries, l2norm) * scale
    key_scale_SUB1 = inverse_norms(keys_i, l2norm)
    beta_SUB1 = beta_ref[...]

    def own_rows(columns, query, key):
        """(q, k of sub-block i decayed from its start and shifted, e^{Γ_c + S}; k; Γ_i; t_i), columns `columns`."""
        g_i = plgpu.load(g_ref.at[:, columns], eviction_policy="evict_first") * LOG2_E
        log_decay = jnp.cumsum(g_i, axis=0)
        from_start = jnp.exp2(log_decay) * SHIFT_UP
        keys = key * key_scale_SUB1
        return (
            query * query_scale_SUB1 * from_start,
            keys * from_start,
            keys,
            log_decay,
            jnp.sum(g_i, axis=0, keepdims=True),
        )

    decayed = [own_rows(*tiles) for tiles in zip(column_blocks, queries, keys_i)]  # once, not per earlier block

    def products_with(j, gaps):
        """(a_qk, L) blocks of sub-block i's rows against the columns of sub-block j < i, and j's gate totals t_j
        per column block; gaps[c] [1, block_k] = t_{j+1} + ... + t_{i-1}."""
        a_qk, L, totals = zeros_SUBSUB, zeros_SUBSUB, []
        for columns, gap, (q_left, k_left, *_) in zip(column_blocks, gaps, decayed):
            total = plgpu.load(totals_ref.at[pl.ds(j, 1), columns], eviction_policy="evict_last")
            right = plgpu.load(right_ref.at[sub_rows(j), columns], eviction_policy="evict_last").astype(jnp.float32) * (
                jnp.exp2(gap) * SHIFT_DOWN
            )  # e^{o_i - G_s - S}
            a_qk, L = a_qk + dots.nt(q_left, right), L + dots.nt(k_left, right)
            totals.append(total)
        return a_qk, L, totals

    def store_earlier(j, a_qk, L):
        a_ref[:, sub_rows(j)] = a_qk.astype(a_ref.dtype)
        blocks_ref[:, sub_rows(j)] = beta_SUB1 * L

    def store_zeros(j):  # a_qk's block right of the diagonal
        a_ref[:, sub_rows(j)] = jnp.zeros((SUB, SUB), a_ref.dtype)

    def earlier_block(m, gaps):  # sub-block j = i - 1 - m
        j = i - 1 - m
        a_qk, L, totals = products_with(j, gaps)
        store_earlier(j, a_qk, L)
        return tuple(gap + total for gap, total in zip(gaps, totals))

    def later_block(j, sums):  # sub-block j > i; sums[c] = t_{i+1} + ... + t_{j-1}
        store_zeros(j)
        return tuple(
            total + plgpu.load(totals_ref.at[pl.ds(j, 1), columns], eviction_policy="evict_last")
            for total, columns in zip(sums, column_blocks)
        )

    zeros_1B = tuple(jnp.zeros((1, block_k), jnp.float32) for _ in column_blocks)
    offsets = jax.lax.fori_loop(0, i, earlier_block, zeros_1B)  # o_i = t_0 + ... + t_{i-1}
    later = jax.lax.fori_loop(i + 1, SUBS, later_block, zeros_1B)  # t_{i+1} + ... + t_3
    for columns, offset, after, (q_left, k_left, keys, log_decay, total) in zip(column_blocks, offsets, later, decayed):
        if any_gate:  # t_i - Γ_c as the sum of the later gates (see the module docstring)
            to_end = suffix_sums(plgpu.load(g_ref.at[:, columns]) * LOG2_E, EXACT_DOT)
        else:
            to_end = total - log_decay
        to_start = jnp.exp2(offset) * SHIFT_DOWN  # e^{o_i - S}: with the left factors' e^{Γ_c + S}, e^{G_c}
        qg_ref[:, columns] = (q_left * to_start).astype(qg_ref.dtype)
        kb_ref[:, columns] = (beta_SUB1 * k_left * to_start).astype(kb_ref.dtype)  # beta e^G k
        kg_ref[:, columns] = (keys * jnp.exp2(to_end + after)).astype(kg_ref.dtype)  # e^{G_last - G} k

        @pl.when(i == SUBS - 1)
        def _():
            decay_ref[:, columns] = jnp.exp2(offset + total)  # e^{G_last} = e^{o_3 + t_3}

    if any_gate:
        scaled_queries = [query * query_scale_SUB1 for query in queries]
        a_qk, strict_U = _exact_diagonal(g_ref, column_blocks, scaled_queries, [rows_i[2] for rows_i in decayed])
    else:
        a_qk, strict_U = _shifted_diagonal(decayed, dots)
    a_ref[:, sub_rows(i)] = jnp.where(rows >= cols, a_qk, 0.0).astype(a_ref.dtype)
    strict_U = jnp.where(rows < cols, strict_U, 0.0) * as_row(beta_SUB1)  # L_ii^T
    blocks_ref[:, sub_rows(i)] = unit_lower_inverse_16(strict_U)


def intra_tiles(dtype, any_gate: bool) -> tuned.IntraTiles:
    """Phase 1's tiles for inputs of this dtype: `tuned.CHUNK_INTRA` (`tuned.CHUNK_INTRA_ANY_GATE` for any gate)."""
    return lookup(tuned.CHUNK_INTRA_ANY_GATE if any_gate else tuned.CHUNK_INTRA, dtype=dtype)


def sub_block_keys(
    k,
    g,
    *,
    use_qk_l2norm: bool,
    parts_dtype,
    tiles: tuned.IntraTiles | None = None,
    any_gate: bool = False,
    interpret: bool = False,
):
    """(right [BH, Tp, K] in parts_dtype: k_s e^{t_j - Γ_s} of every 16-row sub-block j, k l2-normalised when
    asked; totals [BH, Tp / SUB, K] fp32: each sub-block's gate total t_j, log2 units) from k [B, Tp, H, K] and
    g [B, Tp, H, K] fp32. Grid (B*H, Tp / SUB): what `decay_blocks` needs of the sub-blocks other than a program's
    own, formed once rather than by each later sub-block's program. any_gate: for gates below -5 (module
    docstring). Tiles (block_k, num_warps): None from `intra_tiles`."""
    tiles = tiles or intra_tiles(k.dtype, any_gate)
    batch, padded, heads, key_dim = k.shape
    flat, sub_blocks = batch * heads, padded // SUB
    rows = pl.BlockSpec((None, SUB, None, key_dim), lambda bh, s: (bh // heads, s, bh % heads, 0))
    return pl.pallas_call(
        functools.partial(_keys_kernel, l2norm=use_qk_l2norm, block_k=min(tiles.block_k, key_dim), any_gate=any_gate),
        grid=(flat, sub_blocks),
        in_specs=[rows, rows],
        out_specs=[
            pl.BlockSpec((None, SUB, key_dim), lambda bh, s: (bh, s, 0)),
            pl.BlockSpec((None, 1, key_dim), lambda bh, s: (bh, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((flat, padded, key_dim), parts_dtype),
            jax.ShapeDtypeStruct((flat, sub_blocks, key_dim), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret,
        name="kda_prefill_intra_keys" + ("_any_gate" if any_gate else ""),
    )(k, g)


def decay_blocks(
    q,
    k,
    g,
    beta,
    right,
    totals,
    *,
    scale: float,
    use_qk_l2norm: bool,
    parts_dtype,
    tiles: tuned.IntraTiles | None = None,
    any_gate: bool = False,
    interpret: bool = False,
):
    """(qg [BH, Tp, K], a_qk [BH, Tp, CHUNK] in parts_dtype, blocks [BH, Tp, CHUNK] fp32, kb, kg [BH, Tp, K] in
    parts_dtype, decay_last [BH, N, 1, K] fp32) from q, k [B, Tp, H, K], g [B, Tp, H, K] fp32, beta [B, Tp, H, 1]
    fp32 (Tp = N * CHUNK) and `sub_block_keys`' right and totals. Grid (B*H, N, CHUNK / SUB); the keys are worked
    through block_k columns at a time (a power of two). any_gate: for gates below -5 (module docstring). Tiles
    (block_k, num_warps, num_stages): None from `intra_tiles`."""
    tiles = tiles or intra_tiles(q.dtype, any_gate)
    batch, padded, heads, key_dim = q.shape
    flat, num_chunks = batch * heads, padded // CHUNK
    own_rows = lambda width: pl.BlockSpec(  # noqa: E731
        (None, SUB, None, width), lambda bh, n, i: (bh // heads, n * SUBS + i, bh % heads, 0)
    )
    out_rows = lambda width: pl.BlockSpec((None, SUB, width), lambda bh, n, i: (bh, n * SUBS + i, 0))  # noqa: E731
    per_chunk = lambda rows: pl.BlockSpec((None, None, rows, key_dim), lambda bh, n, i: (bh, n, 0, 0))  # noqa: E731
    return pl.pallas_call(
        functools.partial(
            _kernel,
            scale=scale,
            l2norm=use_qk_l2norm,
            input_dtype=q.dtype,
            block_k=min(tiles.block_k, key_dim),
            any_gate=any_gate,
        ),
        grid=(flat, num_chunks, SUBS),  # axis 0 varies fastest
        in_specs=[
            own_rows(key_dim),
            own_rows(key_dim),
            own_rows(key_dim),
            own_rows(1),
            pl.BlockSpec((None, CHUNK, key_dim), lambda bh, n, i: (bh, n, 0)),
            per_chunk(SUBS),
        ],
        out_specs=[
            out_rows(key_dim),
            out_rows(CHUNK),
            out_rows(CHUNK),
            out_rows(key_dim),
            out_rows(key_dim),
            per_chunk(1),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((flat, padded, key_dim), parts_dtype),
            jax.ShapeDtypeStruct((flat, padded, CHUNK), parts_dtype),
            jax.ShapeDtypeStruct((flat, padded, CHUNK), jnp.float32),
            jax.ShapeDtypeStruct((flat, padded, key_dim), parts_dtype),
            jax.ShapeDtypeStruct((flat, padded, key_dim), parts_dtype),
            jax.ShapeDtypeStruct((flat, num_chunks, 1, key_dim), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="kda_prefill_intra_blocks" + ("_any_gate" if any_gate else ""),
    )(q, k, g, beta, right, totals.reshape(flat, num_chunks, SUBS, key_dim))
