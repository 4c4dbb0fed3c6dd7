"""KDA chunked prefill on TPU: a Pallas Mosaic kernel.

Grid (sequence-head, chunk): the chunk axis is sequential ("arbitrary") and carries the [K, V] fp32 state
in VMEM scratch; each step applies `chunk_math.chunk_step` to one SUB-token chunk (fp32 products at
HIGHEST precision) and writes the final state after the last chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda.chunk_math import SUB, Dots, chunk_step
from pallas_kernels.kda.reference import L2_EPS
from pallas_kernels.kda.tpu_mosaic.prep import finish, prepare


def _dot(a, b, contract_a: int, contract_b: int):
    return jax.lax.dot_general(
        a,
        b,
        (((contract_a,), (contract_b,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


_DOTS = Dots(
    nn=functools.partial(_dot, contract_a=1, contract_b=0),
    nt=functools.partial(_dot, contract_a=1, contract_b=1),
    tn=functools.partial(_dot, contract_a=0, contract_b=0),
)


def _l2(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2_EPS)


def _kernel(
    q_ref,
    k_ref,
    v_ref,
    g_ref,
    first_ref,
    last_ref,
    decay_ref,
    beta_ref,
    state_ref,
    o_ref,
    state_out_ref,
    carry_ref,
    *,
    scale,
    use_qk_l2norm,
):
    chunk = pl.program_id(1)

    @pl.when(chunk == 0)
    def _load_initial_state():
        carry_ref[...] = state_ref[...]

    q = q_ref[...].astype(jnp.float32)
    k = k_ref[...].astype(jnp.float32)
    if use_qk_l2norm:
        q, k = _l2(q), _l2(k)
    o, carry_ref[...] = chunk_step(
        q * scale,
        k,
        v_ref[...].astype(jnp.float32),
        g_ref[...],
        first_ref[...],
        last_ref[...],
        decay_ref[...],
        beta_ref[...],
        carry_ref[...],
        _DOTS,
    )
    o_ref[...] = o.astype(o_ref.dtype)

    @pl.when(chunk == pl.num_programs(1) - 1)
    def _store_final_state():
        state_out_ref[...] = carry_ref[...]


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "interpret"))
def chunk_kda_tpu(
    q, k, v, g, beta, initial_state=None, *, scale: float, use_qk_l2norm: bool = True, interpret: bool = False
):
    """(o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32)."""
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    x = prepare(q, k, v, g, beta, initial_state)
    flat, num_chunks = x.q.shape[0], x.q.shape[1] // SUB
    rows = lambda width: pl.BlockSpec((None, SUB, width), lambda i, c: (i, c, 0))  # noqa: E731
    per_chunk = lambda a, b: pl.BlockSpec((None, None, a, b), lambda i, c: (i, c, 0, 0))  # noqa: E731
    state_spec = pl.BlockSpec((None, key_dim, value_dim), lambda i, c: (i, 0, 0))
    o, state = pl.pallas_call(
        functools.partial(_kernel, scale=scale, use_qk_l2norm=use_qk_l2norm),
        grid=(flat, num_chunks),
        in_specs=[
            rows(key_dim),
            rows(key_dim),
            rows(value_dim),
            rows(key_dim),
            per_chunk(1, key_dim),
            per_chunk(1, key_dim),
            per_chunk(key_dim, 1),
            rows(1),
            state_spec,
        ],
        out_specs=[rows(value_dim), state_spec],
        out_shape=[
            jax.ShapeDtypeStruct((flat, num_chunks * SUB, value_dim), v.dtype),
            jax.ShapeDtypeStruct((flat, key_dim, value_dim), jnp.float32),
        ],
        scratch_shapes=[pltpu.VMEM((key_dim, value_dim), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="kda_chunk_prefill",
    )(x.q, x.k, x.v, x.g_cum, x.g_first, x.g_last, x.decay_last, x.beta, x.state)
    return finish(o, state, batch, length, heads)
