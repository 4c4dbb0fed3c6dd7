"""KDA decode step on TPU: a Pallas Mosaic kernel over blocks of heads, the fp32 state updated in place.

Grid (sequence, head block): the [heads, K, V] state block sits in VMEM, is decayed, corrected by the delta
rule and written back over the input (aliased); the output is S^T q per head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda import tuned
from pallas_kernels.kda.reference import L2_EPS
from pallas_kernels.kda.step_math import delta_rule_update
from pallas_kernels.tuning import lookup


def _step_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, state_ref, o_ref, new_state_ref, *, scale, use_qk_l2norm):
    q = q_ref[...].astype(jnp.float32)  # [hb, K]
    k = k_ref[...].astype(jnp.float32)
    if use_qk_l2norm:
        q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=-1, keepdims=True) + L2_EPS)
        k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True) + L2_EPS)
    state = state_ref[...] * jnp.exp(g_ref[...].astype(jnp.float32))[:, :, None]  # [hb, K, V]
    beta = beta_ref[...].astype(jnp.float32)  # [hb, 1]
    state = delta_rule_update(state, k, v_ref[...].astype(jnp.float32), beta)
    new_state_ref[...] = state
    o_ref[...] = jnp.sum((q * scale)[:, :, None] * state, axis=1).astype(o_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("scale", "use_qk_l2norm", "tiles", "interpret"), donate_argnames=("state_BHKV",)
)
def kda_decode_step_tpu(
    q_BHK,
    k_BHK,
    v_BHV,
    g_BHK,
    beta_BH,
    state_BHKV,
    *,
    scale: float,
    use_qk_l2norm: bool = True,
    tiles: tuned.DecodeTpuTiles | None = None,
    interpret: bool = False,
):
    """(o [B, H, V] in v's dtype, new state [B, H, K, V] fp32, written in place of the donated state).
    Tiles: None from `tuned.DECODE_TPU`."""
    head_block = (tiles or lookup(tuned.DECODE_TPU, dtype=v_BHV.dtype)).head_block
    batch, heads, key_dim = q_BHK.shape
    value_dim = v_BHV.shape[-1]
    head_block = head_block if heads % head_block == 0 else heads
    kernel = functools.partial(_step_kernel, scale=scale, use_qk_l2norm=use_qk_l2norm)
    per_head = lambda width: pl.BlockSpec((None, head_block, width), lambda b, h: (b, h, 0))  # noqa: E731
    state_spec = pl.BlockSpec((None, head_block, key_dim, value_dim), lambda b, h: (b, h, 0, 0))
    o, state = pl.pallas_call(
        kernel,
        grid=(batch, heads // head_block),
        in_specs=[
            per_head(key_dim),
            per_head(key_dim),
            per_head(value_dim),
            per_head(key_dim),
            per_head(1),
            state_spec,
        ],
        out_specs=[per_head(value_dim), state_spec],
        out_shape=[
            jax.ShapeDtypeStruct((batch, heads, value_dim), v_BHV.dtype),
            jax.ShapeDtypeStruct((batch, heads, key_dim, value_dim), jnp.float32),
        ],
        input_output_aliases={5: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="kda_decode_step",
    )(
        q_BHK,
        k_BHK,
        v_BHV,
        g_BHK.astype(jnp.float32),
        beta_BH.astype(jnp.float32)[..., None],
        state_BHKV.astype(jnp.float32),
    )
    return o, state
