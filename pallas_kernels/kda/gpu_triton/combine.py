"""The segment-parallel prefill's last step on GPU (`pallas_kernels.kda.segments`): every output from the chunk
kernel's [A_t^T q_t | o_local,t] and the state S_in its segment starts from, o_t = o_local,t + S_in^T (A_t^T q_t),
one Pallas kernel (Triton lowering) that reads the kernel's output in its [N, L, H, K + V] layout and writes
[N, L, H, V]. Under XLA the same product took two transposed copies and a cuBLAS gemm (271 of 954 us of device
time at B=1 T=32768 H=8 over 8 segments on an H100, docs/benchmarks/kda.md). Products as the chunk kernels'
(`gpu_dots`: tf32 for bf16 outputs, IEEE fp32 for fp32 ones)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda.gpu_triton.tril import gpu_dots

BLOCK_L = 64  # tokens a step: a segment is whole 64-token chunks (`segments.SEGMENT_ALIGN`)
MAX_STEPS = 8  # steps a program, a power of two: its [K, V] fp32 state (64 KiB at K = V = 128) read once a 512 tokens


def _kernel(o_ref, state_ref, out_ref, *, key_dim, steps):
    dots = gpu_dots(out_ref.dtype)
    value_dim = out_ref.shape[-1]
    state_KV = state_ref[...]

    def step(i, carry):
        rows = pl.ds(i * BLOCK_L, BLOCK_L)
        carried_LV = dots.nn(o_ref[rows, pl.ds(0, key_dim)].astype(jnp.float32), state_KV)
        local_LV = o_ref[rows, pl.ds(key_dim, value_dim)].astype(jnp.float32)
        out_ref[rows, :] = (local_LV + carried_LV).astype(out_ref.dtype)
        return carry

    jax.lax.fori_loop(0, steps, step, 0)


def takes(key_dim: int, value_dim: int) -> bool:
    """Whether the kernel takes these widths: K and V powers of two (Triton's blocks)."""
    return all(n > 0 and not n & (n - 1) for n in (key_dim, value_dim))


@functools.partial(jax.jit, static_argnames=("interpret",))
def combine_segments_gpu(o_NLHW, incoming_NHKV, *, interpret: bool = False):
    """o [N, L, H, V] in o's dtype from the chunk kernel's o [N, L, H, K + V] ([A_t^T q_t | o_local,t] of N =
    B x segments pieces of L tokens, L a multiple of BLOCK_L) and each piece's incoming state [N, H, K, V] fp32.
    Grid (N x H, L / span): span = steps x BLOCK_L tokens, steps the largest power of two up to MAX_STEPS dividing
    L / BLOCK_L, walked BLOCK_L at a time with the state loaded once; K and V as `takes` allows."""
    pieces, length, heads, width = o_NLHW.shape
    key_dim, value_dim = incoming_NHKV.shape[-2:]
    if width != key_dim + value_dim or length % BLOCK_L:
        raise ValueError(
            f"combine_segments_gpu: o {list(o_NLHW.shape)} must be [N, L, H, K + V] with L a multiple of {BLOCK_L} "
            f"for the states {list(incoming_NHKV.shape)}"
        )
    steps = MAX_STEPS
    while (length // BLOCK_L) % steps:
        steps //= 2
    span = steps * BLOCK_L
    rows = lambda width: pl.BlockSpec((None, span, None, width), lambda nh, l: (nh // heads, l, nh % heads, 0))  # noqa: E731
    return pl.pallas_call(
        functools.partial(_kernel, key_dim=key_dim, steps=steps),
        grid=(pieces * heads, length // span),
        in_specs=[
            rows(width),
            pl.BlockSpec((None, None, key_dim, value_dim), lambda nh, l: (nh // heads, nh % heads, 0, 0)),
        ],
        out_specs=rows(value_dim),
        out_shape=jax.ShapeDtypeStruct((pieces, length, heads, value_dim), o_NLHW.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="kda_prefill_segments_combine",
    )(o_NLHW, incoming_NHKV)
