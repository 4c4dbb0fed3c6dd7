"""KDA prefill on GPU, phase 1 as one kernel (the variants gpu_triton_fused and gpu_triton_fused_any_gate): each
program owns one 64-token chunk of one sequence-head and writes only what the state pass needs (`ChunkParts`);
the decayed queries and keys, the k-k products, the inverse (I + L)^-1 and the rows the WY factors multiply stay
in registers (the three-kernel phase 1 of `intra` hands its keys, blocks and kb over in global memory: >= 5.1 GB
moved at B=1 T=32768, H=64 against this kernel's inputs and parts, about 5.1 GB less its 2.2 GB of intermediates).

Grid (B*H, T/64), the sequence-head fastest (neighbouring programs read neighbouring heads of the same tokens).
A program works on the chunk's four 16-row sub-blocks as separate [16, block_k] tiles (Triton tiles cannot be
sliced by rows), with the math of `blocks` (Γ_i the cumulative log-decay inside sub-block i, t_i its total,
log2 units, shift e^S = 2^58):
1. per column block of the keys: for every sub-block i, its rows decayed from its start and shifted,
   x_c 2^{Γ_c + S} (x = q, k), its keys decayed to its end, k_s 2^{t_i - Γ_s} (<= 1); then the 16x16 blocks
   a_qk_ij, A_ij for j <= i summed over column blocks (off the diagonal the right factor is the keys decayed to
   their sub-block's end times 2^{gap - S}, gap = t_{j+1} + ... + t_{i-1}; on it, as `blocks._shifted_diagonal`
   for gates >= -5, or `exact_decay.pair_products` with any_gate); and the parts that need no inverse:
   qg = q e^G, kg = e^{G_last - G} k, e^{G_last};
2. the inverse of each diagonal block by row updates (`tril.unit_lower_inverse_16`), merged with the blocks L_ij
   below it into X = (I + L)^-1 (`tril.merged_inverse`), all 16x16 register blocks;
3. per column block: w = X (beta e^G k) and u = X (beta v), sub-block j's right-hand rows formed again from the
   inputs (loaded again: the program's rows are in L1/L2) rather than kept alive across the inverse.
Exponentials and precision as in `blocks` (no factor above e^40 for gates >= -5; with any_gate the diagonal
blocks from running products of per-step decays and the decays to a sub-block's end from sums of the later
gates); products as `tril.gpu_dots`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda import tuned
from pallas_kernels.kda.exact_decay import pair_products, suffix_sums
from pallas_kernels.kda.gpu_triton.blocks import (
    EXACT_DOT,
    LOG2_E,
    SHIFT_DOWN,
    SHIFT_UP,
    as_row,
    inverse_norms,
    key_column_blocks,
)
from pallas_kernels.kda.gpu_triton.intra import ChunkParts
from pallas_kernels.kda.gpu_triton.tril import (
    CHUNK,
    SUB,
    SUBS,
    gpu_dots,
    iota_16,
    lower_product,
    merged_inverse,
    sub_rows,
    unit_lower_inverse_16,
)
from pallas_kernels.tuning import fill, lookup


class _Decayed(NamedTuple):
    """One sub-block's [SUB, block_k] fp32 tiles of one column block (log2 units)."""

    queries: jax.Array  # q, l2-normalised and scaled
    keys: jax.Array  # k, l2-normalised
    gates: jax.Array  # g
    log_decay: jax.Array  # Γ = cumsum(g)
    total: jax.Array  # [1, block_k] t = sum(g)
    q_left: jax.Array  # q 2^{Γ + S}
    k_left: jax.Array  # k 2^{Γ + S}
    to_end: jax.Array  # k 2^{t - Γ} (<= 1)


def _tile(ref, i: int, columns):
    return ref[sub_rows(i), columns].astype(jnp.float32)


def _decayed(q_ref, k_ref, g_ref, i: int, columns, query_scale, key_scale, any_gate: bool) -> _Decayed:
    queries, keys = _tile(q_ref, i, columns) * query_scale, _tile(k_ref, i, columns) * key_scale
    gates = g_ref[sub_rows(i), columns] * LOG2_E
    log_decay = jnp.cumsum(gates, axis=0)
    total = jnp.sum(gates, axis=0, keepdims=True)
    from_start = jnp.exp2(log_decay) * SHIFT_UP
    to_end = suffix_sums(gates, EXACT_DOT) if any_gate else total - log_decay  # t - Γ (see blocks' docstring)
    return _Decayed(
        queries, keys, gates, log_decay, total, queries * from_start, keys * from_start, keys * jnp.exp2(to_end)
    )


def _diagonal(tile: _Decayed, any_gate: bool, dots):
    """(a_qk, A^T) of a sub-block against itself, unmasked (`blocks._shifted_diagonal`, `_exact_diagonal`)."""
    if any_gate:
        a_qk, products = pair_products([tile.queries, tile.keys], tile.keys, jnp.exp2(tile.gates))
        return a_qk, products.T
    right = tile.keys * (jnp.exp2(-tile.log_decay) * SHIFT_DOWN)  # 2^{-Γ_s - S}
    return dots.nt(tile.q_left, right), dots.nt(right, tile.k_left)


def _kernel(
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
    block_v,
    any_gate,
):
    dots = gpu_dots(input_dtype)
    rows, cols = iota_16(0), iota_16(1)
    key_blocks = key_column_blocks(k_ref.shape[1], block_k)
    value_blocks = key_column_blocks(v_ref.shape[1], block_v)
    betas = [beta_ref[sub_rows(i), :] for i in range(SUBS)]  # [SUB, 1] each
    query_scales = [inverse_norms([_tile(q_ref, i, c) for c in key_blocks], l2norm) * scale for i in range(SUBS)]
    key_scales = [inverse_norms([_tile(k_ref, i, c) for c in key_blocks], l2norm) for i in range(SUBS)]

    zeros_SS = jnp.zeros((SUB, SUB), jnp.float32)
    a_qk = {(i, j): zeros_SS for i in range(SUBS) for j in range(i + 1)}
    a_kk = dict(a_qk)  # (i, j < i): the k-k products; (i, i): transposed
    offsets = {}  # (column block, i) -> [1, block_k] t_0 + ... + t_{i-1}
    for c, columns in enumerate(key_blocks):
        tiles = [
            _decayed(q_ref, k_ref, g_ref, i, columns, query_scales[i], key_scales[i], any_gate) for i in range(SUBS)
        ]
        for i, tile in enumerate(tiles):
            diagonal_qk, diagonal_kk = _diagonal(tile, any_gate, dots)
            a_qk[i, i], a_kk[i, i] = a_qk[i, i] + diagonal_qk, a_kk[i, i] + diagonal_kk
            gap = jnp.zeros_like(tile.total)
            for j in reversed(range(i)):
                right = tiles[j].to_end * (jnp.exp2(gap) * SHIFT_DOWN)  # k_s 2^{o_i - G_s - S}
                a_qk[i, j] = a_qk[i, j] + dots.nt(tile.q_left, right)
                a_kk[i, j] = a_kk[i, j] + dots.nt(tile.k_left, right)
                gap = gap + tiles[j].total
            offsets[c, i] = gap
            qg_ref[sub_rows(i), columns] = (tile.q_left * (jnp.exp2(gap) * SHIFT_DOWN)).astype(qg_ref.dtype)
        later = jnp.zeros_like(tiles[0].total)  # t_{i+1} + ... + t_3
        for i in reversed(range(SUBS)):
            kg_ref[sub_rows(i), columns] = (tiles[i].to_end * jnp.exp2(later)).astype(kg_ref.dtype)
            later = later + tiles[i].total
        decay_ref[:, columns] = jnp.exp2(offsets[c, SUBS - 1] + tiles[SUBS - 1].total)

    for i in range(SUBS):
        for j in range(SUBS):
            block = jnp.where(rows >= cols, a_qk[i, i], 0.0) if i == j else a_qk.get((i, j), zeros_SS)
            a_ref[sub_rows(i), sub_rows(j)] = block.astype(a_ref.dtype)

    def block(i, j):  # D_i on the diagonal, L_ij = diag(beta_i) A_ij below it
        if i == j:
            return unit_lower_inverse_16(jnp.where(rows < cols, a_kk[i, i], 0.0) * as_row(betas[i]))
        return betas[i] * a_kk[i, j]

    inverse = merged_inverse(block, dots)

    for c, columns in enumerate(key_blocks):

        def decayed_keys(j, c=c, columns=columns):  # beta e^G k
            gates = g_ref[sub_rows(j), columns] * LOG2_E
            decay = jnp.exp2(jnp.cumsum(gates, axis=0) + offsets[c, j])
            return betas[j] * _tile(k_ref, j, columns) * key_scales[j] * decay

        for i in range(SUBS):
            w_ref[sub_rows(i), columns] = lower_product(inverse, i, decayed_keys, dots).astype(w_ref.dtype)
    for columns in value_blocks:
        for i in range(SUBS):
            u = lower_product(inverse, i, lambda j, columns=columns: betas[j] * _tile(v_ref, j, columns), dots)
            u_ref[sub_rows(i), columns] = u.astype(u_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "use_qk_l2norm",
        "parts_dtype",
        "block_k",
        "block_v",
        "num_warps",
        "any_gate",
        "interpret",
    ),
)
def fused_intra_chunk(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale: float,
    use_qk_l2norm: bool = True,
    parts_dtype=None,
    block_k: int | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
    any_gate: bool = False,
    interpret: bool = False,
) -> ChunkParts:
    """Phase 1 in one pallas_call, grid (B*H, Tp / CHUNK): the same `ChunkParts` as `intra.intra_chunk` from the
    same inputs (q, k [B, Tp, H, K], v [B, Tp, H, V], g [B, Tp, H, K] fp32, beta [B, Tp, H, 1] fp32, Tp a
    multiple of CHUNK; parts in parts_dtype, default v's). block_k / block_v: the key / value columns a step
    works on (powers of two); any_gate: for gates below -5. None: `tuned.CHUNK_FUSED`
    (`tuned.CHUNK_FUSED_ANY_GATE`)."""
    table = tuned.CHUNK_FUSED_ANY_GATE if any_gate else tuned.CHUNK_FUSED
    block_k, block_v, num_warps = fill((block_k, block_v, num_warps), lookup(table, dtype=v.dtype))
    dtype = v.dtype if parts_dtype is None else parts_dtype
    batch, padded, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    flat, num_chunks = batch * heads, padded // CHUNK
    chunk_rows = lambda width: pl.BlockSpec(  # noqa: E731
        (None, CHUNK, None, width), lambda bh, n: (bh // heads, n, bh % heads, 0)
    )
    out_rows = lambda width: pl.BlockSpec((None, CHUNK, width), lambda bh, n: (bh, n, 0))  # noqa: E731
    parts = lambda width: jax.ShapeDtypeStruct((flat, padded, width), dtype)  # noqa: E731
    w, u, qg, kg, a_qk, decay_last = pl.pallas_call(
        functools.partial(
            _kernel,
            scale=scale,
            l2norm=use_qk_l2norm,
            input_dtype=v.dtype,
            block_k=min(block_k, key_dim),
            block_v=min(block_v, value_dim),
            any_gate=any_gate,
        ),
        grid=(flat, num_chunks),  # axis 0 varies fastest
        in_specs=[chunk_rows(key_dim), chunk_rows(key_dim), chunk_rows(key_dim), chunk_rows(value_dim), chunk_rows(1)],
        out_specs=[
            out_rows(key_dim),
            out_rows(value_dim),
            out_rows(key_dim),
            out_rows(key_dim),
            out_rows(CHUNK),
            pl.BlockSpec((None, None, 1, key_dim), lambda bh, n: (bh, n, 0, 0)),
        ],
        out_shape=[
            parts(key_dim),
            parts(value_dim),
            parts(key_dim),
            parts(key_dim),
            parts(CHUNK),
            jax.ShapeDtypeStruct((flat, num_chunks, 1, key_dim), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_prefill_fused_intra" + ("_any_gate" if any_gate else ""),
    )(q, k, g, v, beta)
    return ChunkParts(w, u, qg, kg, a_qk, decay_last)
