"""KDA chunked prefill on TPU: Pallas Mosaic kernels, one for gates >= -5 (`chunk_kda_tpu`) and one for gates
of any size (`chunk_kda_tpu_any_gate`).

Grid (sequence-head, chunk): the chunk axis is sequential ("arbitrary") and carries the [K, V] fp32 state
in VMEM scratch; each step applies a chunk step to one SUB-token chunk (fp32 products at HIGHEST precision)
and writes the final state after the last chunk. The bounded kernel's step is `chunk_math.chunk_step`, whose
pair decays are factors per row (e^{G_0 - G} up to e^80); the any-gate kernel's is
`exact_decay.chunk_step_any_gate`, whose are running products of per-step decays (no factor above 1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda.chunk_math import SUB, Dots, chunk_step
from pallas_kernels.kda.exact_decay import chunk_step_any_gate
from pallas_kernels.kda.reference import L2_EPS
from pallas_kernels.kda.tpu_mosaic.prep import any_gates, bounded_gates, finish, prepare


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


def _kernel(q_ref, k_ref, v_ref, beta_ref, state_ref, *refs, step, scale, use_qk_l2norm):
    """refs: the step's gate inputs, then the outputs o and final state, then the state carried in VMEM."""
    *gate_refs, o_ref, state_out_ref, carry_ref = refs
    chunk = pl.program_id(1)

    @pl.when(chunk == 0)
    def _load_initial_state():
        carry_ref[...] = state_ref[...]

    q = q_ref[...].astype(jnp.float32)
    k = k_ref[...].astype(jnp.float32)
    if use_qk_l2norm:
        q, k = _l2(q), _l2(k)
    o, carry_ref[...] = step(
        q * scale,
        k,
        v_ref[...].astype(jnp.float32),
        *(gate_ref[...] for gate_ref in gate_refs),
        beta_ref[...],
        carry_ref[...],
        _DOTS,
    )
    o_ref[...] = o.astype(o_ref.dtype)

    @pl.when(chunk == pl.num_programs(1) - 1)
    def _store_final_state():
        state_out_ref[...] = carry_ref[...]


def _gate_spec(gate):
    """The block of one gate input: SUB rows of a [BH, Tp, K] array, or one chunk's [a, b] of [BH, N, a, b]."""
    if gate.ndim == 3:
        return pl.BlockSpec((None, SUB, gate.shape[-1]), lambda i, c: (i, c, 0))
    return pl.BlockSpec((None, None, *gate.shape[-2:]), lambda i, c: (i, c, 0, 0))


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "any_gate", "interpret"))
def _chunk_kda(q, k, v, g, beta, initial_state, *, scale: float, use_qk_l2norm: bool, any_gate: bool, interpret: bool):
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    x = prepare(q, k, v, g, beta, initial_state, any_gates if any_gate else bounded_gates)
    flat, num_chunks = x.q.shape[0], x.q.shape[1] // SUB
    rows = lambda width: pl.BlockSpec((None, SUB, width), lambda i, c: (i, c, 0))  # noqa: E731
    state_spec = pl.BlockSpec((None, key_dim, value_dim), lambda i, c: (i, 0, 0))
    o, state = pl.pallas_call(
        functools.partial(
            _kernel,
            step=chunk_step_any_gate if any_gate else chunk_step,
            scale=scale,
            use_qk_l2norm=use_qk_l2norm,
        ),
        grid=(flat, num_chunks),
        in_specs=[rows(key_dim), rows(key_dim), rows(value_dim), rows(1), state_spec, *map(_gate_spec, x.gates)],
        out_specs=[rows(value_dim), state_spec],
        out_shape=[
            jax.ShapeDtypeStruct((flat, num_chunks * SUB, value_dim), v.dtype),
            jax.ShapeDtypeStruct((flat, key_dim, value_dim), jnp.float32),
        ],
        scratch_shapes=[pltpu.VMEM((key_dim, value_dim), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="kda_chunk_prefill_any_gate" if any_gate else "kda_chunk_prefill",
    )(x.q, x.k, x.v, x.beta, x.state, *x.gates)
    return finish(o, state, batch, length, heads)


def chunk_kda_tpu(
    q, k, v, g, beta, initial_state=None, *, scale: float, use_qk_l2norm: bool = True, interpret: bool = False
):
    """(o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32) for log-decays g >= -5
    (`chunk_math.GATE_FLOOR`); below it the pair decays overflow fp32."""
    return _chunk_kda(
        q, k, v, g, beta, initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm, any_gate=False, interpret=interpret
    )


def chunk_kda_tpu_any_gate(
    q, k, v, g, beta, initial_state=None, *, scale: float, use_qk_l2norm: bool = True, interpret: bool = False
):
    """`chunk_kda_tpu` for log-decays g <= 0 of any size (e.g. -A softplus(a) without the safe gate)."""
    return _chunk_kda(
        q, k, v, g, beta, initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm, any_gate=True, interpret=interpret
    )
