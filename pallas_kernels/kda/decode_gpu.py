"""KDA decode step on GPU: a Pallas kernel (Triton lowering) streaming the recurrent state once.

Program (value block, group of sequence-heads) updates the [K, block_v] slice of each head's fp32 state:
S <- diag(e^g) S; S <- S + k beta (v - S^T k)^T; o = S^T q, written back over the input (aliased). The step
is bound by state traffic: 2 x 4 bytes x K x V per head, read and written once.

Variants (keywords of `kda_decode_step_gpu`), to hide a program's load latency:
- whole slice (chunk_k=None, the default): one load of the slice, the update, one store.
- K-chunked (chunk_k rows at a time): two loops over the slice's row chunks. The first decays each chunk and
  accumulates S^T k and S^T q; the second re-reads each chunk (an L2 hit: the program read it just before),
  decays and corrects it, and stores it. The output needs no third pass: S'^T q = (DS)^T q + delta (k . q).
  Each iteration issues the next chunk's loads before its own arithmetic and store (a register double buffer
  carried by the loop): Triton software-pipelines only loops that feed a dot or carry a per-loop tt.num_stages
  attribute, which Pallas does not emit, so num_stages would not pipeline these loops. Keeping the decayed
  slice in registers instead would need all chunks loaded before the first store, which is the whole-slice
  kernel again (a loop cannot grow a register tile), so re-reading from L2 is the only way to overlap.
- heads_per_program > 1: each program walks several sequence-heads in a loop (fewer, longer programs); with
  chunk_k, the second pass's last iteration loads the next head's first chunk, so the stream never stalls
  between heads.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda.reference import L2_EPS


def _inverse_norm(x_K, use_qk_l2norm):
    """1 / ||x||_2 (eps-guarded), or 1 when the inputs are used as given."""
    return jax.lax.rsqrt(jnp.sum(x_K * x_K) + L2_EPS) if use_qk_l2norm else 1.0


def _normalized(x_ref, h, use_qk_l2norm):
    """Row h of x_ref in fp32, L2-normalised when asked."""
    x_K = x_ref[h, :].astype(jnp.float32)
    return x_K * _inverse_norm(x_K, use_qk_l2norm)


def _whole_slice_step(refs, h, carry, *, scale, use_qk_l2norm):
    """One head's update with its [K, bv] slice loaded at once (carry: unused, passed through)."""
    q_ref, k_ref, v_ref, g_ref, beta_ref, state_ref, o_ref, new_state_ref = refs
    q_K, k_K = _normalized(q_ref, h, use_qk_l2norm), _normalized(k_ref, h, use_qk_l2norm)
    state_KV = state_ref[h, :, :] * jnp.exp(g_ref[h, :])[:, None]
    delta_V = beta_ref[h] * (v_ref[h, :].astype(jnp.float32) - jnp.sum(k_K[:, None] * state_KV, 0))
    state_KV = state_KV + k_K[:, None] * delta_V[None, :]
    new_state_ref[h, :, :] = state_KV
    o_ref[h, :] = jnp.sum((q_K * scale)[:, None] * state_KV, axis=0).astype(o_ref.dtype)
    return carry


def _load_chunk(refs, h, c, chunk_k):
    """Raw (state [c_k, bv], g [c_k], k [c_k], q [c_k]) rows of chunk c of head h."""
    q_ref, k_ref, _, g_ref, _, state_ref, _, _ = refs
    rows = pl.ds(c * chunk_k, chunk_k)
    return state_ref[h, rows, :], g_ref[h, rows], k_ref[h, rows], q_ref[h, rows]


def _chunked_step(refs, h, chunk0, *, scale, use_qk_l2norm, chunk_k, heads):
    """One head's update in two passes over chunk_k-row chunks of its [K, bv] slice, each chunk's loads issued
    one chunk ahead (chunk0: head h's first chunk, already loaded). Returns the next head's first chunk."""
    q_ref, k_ref, v_ref, _, beta_ref, _, o_ref, new_state_ref = refs
    inv_q, inv_k = (_inverse_norm(x_ref[h, :].astype(jnp.float32), use_qk_l2norm) for x_ref in (q_ref, k_ref))
    chunks = q_ref.shape[-1] // chunk_k

    def decayed(loaded):
        """(decayed state rows [c_k, bv], normalised k rows [c_k], normalised q rows [c_k])."""
        state_CV, g_C, k_C, q_C = loaded
        return (state_CV * jnp.exp(g_C)[:, None], k_C.astype(jnp.float32) * inv_k,
                q_C.astype(jnp.float32) * inv_q)

    def project(c, carry):  # the last prefetch is chunk 0 again, for the second pass
        loaded, (by_k_V, by_q_V, kq) = carry
        state_CV, k_C, q_C = decayed(loaded)
        sums = (by_k_V + jnp.sum(k_C[:, None] * state_CV, 0), by_q_V + jnp.sum(q_C[:, None] * state_CV, 0),
                kq + jnp.sum(k_C * q_C))
        return _load_chunk(refs, h, jnp.where(c + 1 == chunks, jnp.int32(0), c + 1), chunk_k), sums

    zeros_V = jnp.zeros(v_ref.shape[-1:], jnp.float32)
    loaded, (by_k_V, by_q_V, kq) = jax.lax.fori_loop(0, chunks, project,
                                                     (chunk0, (zeros_V, zeros_V, jnp.float32(0.0))))
    delta_V = beta_ref[h] * (v_ref[h, :].astype(jnp.float32) - by_k_V)
    o_ref[h, :] = (scale * (by_q_V + kq * delta_V)).astype(o_ref.dtype)  # S'^T q = (DS)^T q + delta (k . q)

    def update(c, loaded):  # the last prefetch is the next head's chunk 0 (the last head: this chunk again)
        state_CV, k_C, _ = decayed(loaded)
        head = jnp.asarray(h, jnp.int32)  # int32 operands only: Triton's select takes no i1/i32 mix
        last = c + 1 == chunks
        next_head = jnp.logical_and(last, head + 1 < heads)
        prefetched = _load_chunk(refs, jnp.where(next_head, head + 1, head),
                                 jnp.where(last, jnp.where(next_head, jnp.int32(0), c), c + 1), chunk_k)
        new_state_ref[h, pl.ds(c * chunk_k, chunk_k), :] = (
            state_CV + k_C[:, None] * delta_V[None, :])
        return prefetched

    return jax.lax.fori_loop(0, chunks, update, loaded)


def _step_kernel(*refs, heads, chunk_k, scale, use_qk_l2norm):
    """The program's sequence-heads one after another (inline for one, a loop for several)."""
    if chunk_k is None:
        head_step = functools.partial(_whole_slice_step, refs, scale=scale, use_qk_l2norm=use_qk_l2norm)
        carry = ()
    else:
        head_step = functools.partial(_chunked_step, refs, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                      chunk_k=chunk_k, heads=heads)
        carry = _load_chunk(refs, 0, 0, chunk_k)
    if heads == 1:
        head_step(0, carry)
    else:
        jax.lax.fori_loop(0, heads, head_step, carry)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "block_v", "num_warps", "chunk_k",
                                             "heads_per_program", "interpret"),
                   donate_argnames=("state_BHKV",))
def kda_decode_step_gpu(q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, state_BHKV, *, scale: float, use_qk_l2norm: bool = True,
                        block_v: int = 64, num_warps: int = 4, chunk_k: int | None = None, heads_per_program: int = 1,
                        interpret: bool = False):
    """(o [B, H, V] in v's dtype, new state [B, H, K, V] fp32, written in place of the donated state).

    chunk_k: rows of the state slice per pipelined chunk (None: the whole slice at once); a divisor of K.
    heads_per_program: sequence-heads one program walks (lowered to a divisor of B x H).
    """
    batch, heads, key_dim = q_BHK.shape
    value_dim = v_BHV.shape[-1]
    block_v = min(block_v, value_dim)
    flat = batch * heads
    group = math.gcd(heads_per_program, flat)
    if chunk_k is not None:
        chunk_k = min(chunk_k, key_dim)
        assert key_dim % chunk_k == 0, (key_dim, chunk_k)
    q, k, g = (x.reshape(flat, key_dim) for x in (q_BHK, k_BHK, g_BHK))
    v, beta = v_BHV.reshape(flat, value_dim), beta_BH.reshape(flat)
    state = state_BHKV.reshape(flat, key_dim, value_dim)
    row = pl.BlockSpec((group, key_dim), lambda j, i: (i, 0))
    value_block = pl.BlockSpec((group, block_v), lambda j, i: (i, j))
    state_block = pl.BlockSpec((group, key_dim, block_v), lambda j, i: (i, 0, j))
    o, state = pl.pallas_call(
        functools.partial(_step_kernel, heads=group, chunk_k=chunk_k, scale=scale, use_qk_l2norm=use_qk_l2norm),
        grid=(pl.cdiv(value_dim, block_v), flat // group),
        in_specs=[row, row, value_block, row, pl.BlockSpec((group,), lambda j, i: (i,)), state_block],
        out_specs=[value_block, state_block],
        out_shape=[jax.ShapeDtypeStruct((flat, value_dim), v_BHV.dtype),
                   jax.ShapeDtypeStruct((flat, key_dim, value_dim), jnp.float32)],
        input_output_aliases={5: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_decode_step",
    )(q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32), state.astype(jnp.float32))
    return o.reshape(batch, heads, value_dim), state.reshape(batch, heads, key_dim, value_dim)
