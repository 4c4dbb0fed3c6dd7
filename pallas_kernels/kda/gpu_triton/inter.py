"""KDA prefill on GPU, phase 2 of 2: the state carried across chunks (64 tokens, or 16 for `short_chunks`), a Pallas
kernel (Triton lowering).

Program (value block, sequence-head) keeps its [K, block_v] slice of the fp32 state S in registers and walks
the chunks in order, using phase 1's per-chunk parts (`intra.ChunkParts`):
  v_new = u - w S;  o = qg S + a_qk v_new;  S <- e^{G_last} S + kg^T v_new.
The output is formed here rather than in a third, parallel pass over stored per-chunk states: at the shapes
that matter (B*H*V/block_v programs ~ one wave of SMs) the two output products do not depend on the next
state, so they fill issue slots the state chain leaves idle, while storing the states would cost
2 x T/64 x H x K x V values of memory traffic (1 GiB each way at T=32768, H=64, bf16) for nothing else.
Operands are in the parts' dtype: bf16 parts (the default for bf16 inputs, as in FLA: half the memory
traffic of fp32 ones) give bf16 tensor-core products, the state and v_new rounded to bf16 as operands only
(both stay fp32); fp32 parts give tf32 products for bf16 inputs and IEEE fp32 ones for fp32 inputs.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda import tuned
from pallas_kernels.kda.gpu_triton.intra import ChunkParts, PairedParts, gpu_dots
from pallas_kernels.tuning import lookup


def _live(zero_blocks: int):
    """Whether this program's values are stored ones: False in the programs of the first zero_blocks value blocks
    (`inter_chunk`'s zero_columns: those values are zero and not stored; such a program reads the first stored
    block and zeroes it); None where there are none. Read at the kernel's top, outside its loop."""
    return pl.program_id(0) >= zero_blocks if zero_blocks else None


def _values(ref, rows, live):
    """ref's rows in fp32, zeros where `live` (`_live`) is False."""
    values = ref[rows, :].astype(jnp.float32)
    return values if live is None else jnp.where(live, values, 0.0)


def _kernel(
    w_ref, u_ref, qg_ref, kg_ref, a_ref, decay_ref, state_ref, o_ref, state_out_ref, *, num_chunks, zero_blocks
):
    dots = gpu_dots(o_ref.dtype)
    live = _live(zero_blocks)
    size = a_ref.shape[-1]  # tokens a chunk

    def chunk(n, state_KV):
        rows = pl.ds(n * size, size)
        decay_K1 = decay_ref[n]  # loaded first, as in `_kernel_state_rows`
        state_operand = state_KV.astype(w_ref.dtype)
        v_new = _values(u_ref, rows, live) - dots.nn(w_ref[rows, :], state_operand)  # [size, block_v]
        v_new_operand = v_new.astype(w_ref.dtype)
        o = dots.nn(qg_ref[rows, :], state_operand) + dots.nn(a_ref[rows, :], v_new_operand)
        o_ref[rows, :] = o.astype(o_ref.dtype)
        return decay_K1 * state_KV + dots.tn(kg_ref[rows, :], v_new_operand)

    state_out_ref[...] = jax.lax.fori_loop(0, num_chunks, chunk, state_ref[...])


def _kernel_state_rows(
    w_ref, u_ref, qg_ref, kg_ref, a_ref, decay_ref, state_ref, o_ref, state_out_ref, *, num_chunks, zero_blocks
):
    """`_kernel` with the state held transposed, S^T [block_v, K], so that every product of the step has the
    state's block_v rows (or v_new^T's) as its M side: at 16-token chunks M = 16 otherwise, too few rows for a
    Hopper warpgroup's tensor-core instruction (M = 64)."""
    dots = gpu_dots(o_ref.dtype)
    live = _live(zero_blocks)
    size = a_ref.shape[-1]

    def chunk(n, state_VK):
        rows = pl.ds(n * size, size)
        decay_1K = decay_ref[n]  # loaded first: its latency passes under the products (after o's store it did not)
        state_operand = state_VK.astype(w_ref.dtype)
        v_new_VC = _values(u_ref, rows, live).T - dots.nt(state_operand, w_ref[rows, :])
        v_new_operand = v_new_VC.astype(w_ref.dtype)
        o_VC = dots.nt(state_operand, qg_ref[rows, :]) + dots.nt(v_new_operand, a_ref[rows, :])
        o_ref[rows, :] = o_VC.T.astype(o_ref.dtype)
        return decay_1K * state_VK + dots.nn(v_new_operand, kg_ref[rows, :])

    state_out_ref[...] = jax.lax.fori_loop(0, num_chunks, chunk, state_ref[...])


def _kernel_paired(wq_ref, ua_ref, kg_ref, decay_ref, state_ref, o_ref, state_out_ref, *, num_chunks, zero_blocks):
    """`_kernel_state_rows` on `intra.PairedParts`: one product of the state with a chunk's 2C rows of wq gives
    S w^T and S (qg - a_qk w)^T with their columns interleaved; adding ua^T's (u, a_qk u) columns, the first negated,
    gives v_new^T and o^T at once (split by column parity, within each thread's registers)."""
    dots = gpu_dots(o_ref.dtype)
    live = _live(zero_blocks)
    size = kg_ref.shape[0] // num_chunks
    signs_1P = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (1, 2 * size), 1) % 2 == 0, -1.0, 1.0)

    def chunk(n, state_VK):
        rows, pair_rows = pl.ds(n * size, size), pl.ds(n * 2 * size, 2 * size)
        decay_1K = decay_ref[n]  # loaded first, as in `_kernel_state_rows`
        state_operand = state_VK.astype(wq_ref.dtype)
        sums_VP = _values(ua_ref, pair_rows, live).T + signs_1P * dots.nt(state_operand, wq_ref[pair_rows, :])
        v_new_VC, o_VC = jnp.unstack(sums_VP.reshape(sums_VP.shape[0], size, 2), axis=-1)
        o_ref[rows, :] = o_VC.T.astype(o_ref.dtype)
        return decay_1K * state_VK + dots.nn(v_new_VC.astype(wq_ref.dtype), kg_ref[rows, :])

    state_out_ref[...] = jax.lax.fori_loop(0, num_chunks, chunk, state_ref[...])


@functools.partial(jax.jit, static_argnames=("out_dtype", "tiles", "zero_columns", "interpret"))
def inter_chunk(
    parts: ChunkParts | PairedParts,
    initial_state,
    *,
    out_dtype,
    tiles: tuned.InterTiles | None = None,
    zero_columns: int = 0,
    interpret: bool = False,
):
    """Phase 2: (o [B, Tp, H, V] in out_dtype, final state [B, H, K, V] fp32) from phase 1's parts (chunks of
    a_qk's last dimension: CHUNK, or 16 for `short_chunks`; `intra.PairedParts` from its paired phase 1, which
    needs tiles.state_rows) and the initial state [B, H, K, V] fp32. Grid (V / block_v, B*H); each program runs
    all the chunks, holding its state slice as [K, block_v] or, with tiles.state_rows, transposed as [block_v,
    K]. zero_columns: the values' first zero_columns columns are zero and not in the parts (u's V -
    zero_columns columns are the rest): the segment-parallel prefill's transition columns (`segments`), which
    phase 1 then never forms. Tiles: None from `tuned.CHUNK_INTER`."""
    tiles = tiles or lookup(tuned.CHUNK_INTER, dtype=out_dtype)
    batch, heads, key_dim, value_dim = initial_state.shape
    paired = isinstance(parts, PairedParts)
    stored = (parts.ua if paired else parts.u).shape[-1]
    if stored + zero_columns != value_dim:
        raise ValueError(
            f"inter_chunk: {stored} stored value columns and {zero_columns} zero ones, but the state has {value_dim}"
        )
    if paired and not tiles.state_rows:
        raise ValueError("inter_chunk: paired parts need the state held transposed (tiles.state_rows)")
    flat, padded = parts.kg.shape[:2]
    num_chunks = parts.decay_last.shape[1]
    size = padded // num_chunks
    block_v = min(tiles.block_v, value_dim)
    if zero_columns % block_v:
        block_v = math.gcd(block_v, zero_columns)  # whole blocks of zeros (a power of two's share for K = 128)
    zero_blocks = zero_columns // block_v
    whole = lambda length, width: pl.BlockSpec((None, length, width), lambda j, bh: (bh, 0, 0))  # noqa: E731
    value_part = lambda length: pl.BlockSpec(  # noqa: E731
        (None, length, block_v), lambda j, bh: (bh, 0, jnp.maximum(j - zero_blocks, 0))
    )
    if tiles.state_rows:  # the state as S^T [V, K], its value rows split; the chunk decays as [1, K] rows
        decay = parts.decay_last
        per_chunk = pl.BlockSpec((None, num_chunks, 1, key_dim), lambda j, bh: (bh, 0, 0, 0))
        state_part = pl.BlockSpec((None, block_v, key_dim), lambda j, bh: (bh, j, 0))
        state_in, state_shape = initial_state.reshape(flat, key_dim, value_dim).swapaxes(1, 2), (value_dim, key_dim)
    else:
        decay = parts.decay_last.reshape(flat, num_chunks, key_dim, 1)
        per_chunk = pl.BlockSpec((None, num_chunks, key_dim, 1), lambda j, bh: (bh, 0, 0, 0))
        state_part = pl.BlockSpec((None, key_dim, block_v), lambda j, bh: (bh, 0, j))
        state_in, state_shape = initial_state.reshape(flat, key_dim, value_dim), (key_dim, value_dim)
    if paired:
        kernel = _kernel_paired
        operands = (parts.wq, parts.ua, parts.kg)
        in_specs = [whole(2 * padded, key_dim), value_part(2 * padded), whole(padded, key_dim)]
    else:
        kernel = _kernel_state_rows if tiles.state_rows else _kernel
        operands = (parts.w, parts.u, parts.qg, parts.kg, parts.a_qk)
        in_specs = [
            whole(padded, key_dim),
            value_part(padded),
            whole(padded, key_dim),
            whole(padded, key_dim),
            whole(padded, size),
        ]
    o, state = pl.pallas_call(
        functools.partial(kernel, num_chunks=num_chunks, zero_blocks=zero_blocks),
        grid=(pl.cdiv(value_dim, block_v), flat),
        in_specs=[*in_specs, per_chunk, state_part],
        out_specs=[
            pl.BlockSpec((None, padded, None, block_v), lambda j, bh: (bh // heads, 0, bh % heads, j)),
            state_part,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, padded, heads, value_dim), out_dtype),
            jax.ShapeDtypeStruct((flat, *state_shape), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="kda_prefill_inter_chunk",
    )(*operands, decay, state_in)
    if tiles.state_rows:
        state = state.swapaxes(1, 2)
    return o, state.reshape(batch, heads, key_dim, value_dim)
