"""A KDA layer's decode step between its projections in one Pallas kernel (Triton lowering): short convs, gates,
L2 norms, the recurrence and the gated output norm (`reference.kda_decode_fused`, in the same order and
roundings).

One program per sequence-head: it convolves the head's q, k and v rows with their conv windows (and writes the
shifted windows out), forms g and beta from their pre-activations, then walks the head's [K, V] fp32 state
block_v value columns at a time (S <- diag(e^g) S; S <- S + k beta (v - S^T k)^T; o = S^T q, the state written
back over the input: aliased), and last normalises the head's whole output row, which is why a program holds all
of V (the value-blocked `decode.py` cannot: its programs see a block_v slice of the row each). The windows are
written out of place: a program's shifted rows would overwrite rows that another warp of it may not have read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda import tuned
from pallas_kernels.kda.reference import L2_EPS, DecodeWeights
from pallas_kernels.tuning import lookup

Q, K, V = 0, 1, 2  # the conv window's [q; k; v] rows


def _conv_silu(window_ref, new_window_ref, u_ref, weight_ref, which, columns, dtype, real):
    """The short conv + SiLU of one of q, k, v over `columns`, rounded to dtype then fp32 as the model's ops are
    (0 for a pad token); the window, shifted (not for a pad), written to new_window_ref."""
    taps = weight_ref.shape[-1]
    rows = [window_ref[j, which, columns].astype(dtype) for j in range(taps - 1)] + [u_ref[columns].astype(dtype)]
    conv = sum(row.astype(jnp.float32) * weight_ref[columns, j].astype(jnp.float32) for j, row in enumerate(rows))
    for j in range(taps - 1):
        new_window_ref[j, which, columns] = jnp.where(real, rows[j + 1], rows[j]).astype(new_window_ref.dtype)
    return jnp.where(real, jax.nn.silu(conv).astype(dtype).astype(jnp.float32), 0.0)


def _l2_normalized(x_K):
    return x_K * jax.lax.rsqrt(jnp.sum(x_K * x_K) + L2_EPS)


def _fused_kernel(
    q_ref, k_ref, v_ref, f_ref, b_ref, gate_ref, window_ref, state_ref, *refs, scale, lower_bound, eps, block_v
):
    """One sequence-head: its convs, gates, state update and normed output."""
    conv_q_ref, conv_k_ref, conv_v_ref, dt_bias_ref, a_log_ref, norm_weight_ref = refs[:6]  # `DecodeWeights`' order
    real_ref, o_ref, new_window_ref, new_state_ref = refs[6:]
    dtype = v_ref.dtype
    key_dim, value_dim = state_ref.shape
    keys = pl.ds(0, key_dim)
    real = real_ref[...] != 0
    conv_silu = functools.partial(_conv_silu, window_ref, new_window_ref, dtype=dtype, real=real)
    q_K = _l2_normalized(conv_silu(q_ref, conv_q_ref, Q, keys)) * scale
    k_K = _l2_normalized(conv_silu(k_ref, conv_k_ref, K, keys))
    a_K = f_ref[...].astype(jnp.float32) + dt_bias_ref[...]
    decay_rate = jnp.exp(a_log_ref[...])
    if lower_bound is None:
        g_K = -decay_rate * jax.nn.softplus(a_K)
    else:
        g_K = lower_bound * jax.nn.sigmoid(decay_rate * a_K)
    decay_K = jnp.where(real, jnp.exp(g_K), 1.0)
    beta = jnp.where(real, jax.nn.sigmoid(b_ref[...].astype(jnp.float32)), 0.0)
    outputs = []
    for start in range(0, value_dim, block_v):
        columns = pl.ds(start, block_v)
        v_V = conv_silu(v_ref, conv_v_ref, V, columns)
        state_KV = state_ref[:, columns] * decay_K[:, None]
        delta_V = beta * (v_V - jnp.sum(k_K[:, None] * state_KV, axis=0))
        state_KV = state_KV + k_K[:, None] * delta_V[None, :]
        new_state_ref[:, columns] = state_KV
        outputs.append(jnp.sum(q_K[:, None] * state_KV, axis=0).astype(dtype).astype(jnp.float32))
    mean_square = sum(jnp.sum(o_V * o_V) for o_V in outputs) / value_dim
    inverse_rms = jax.lax.rsqrt(mean_square + eps)
    for start, o_V in zip(range(0, value_dim, block_v), outputs):
        columns = pl.ds(start, block_v)
        weight_V = norm_weight_ref[columns].astype(jnp.float32)
        gate_V = jax.nn.sigmoid(gate_ref[columns].astype(jnp.float32))
        o_ref[columns] = (o_V * inverse_rms * weight_V * gate_V).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "lower_bound", "eps", "tiles", "interpret"),
    donate_argnames=("state_BHKV",),
)
def kda_decode_fused_gpu(
    q_BHK,
    k_BHK,
    v_BHV,
    f_BHK,
    b_BH,
    gate_BHV,
    conv_window_BW3HK,
    state_BHKV,
    weights: DecodeWeights,
    *,
    real_B=None,
    scale: float,
    lower_bound: float | None,
    eps: float,
    tiles: tuned.DecodeGpuTiles | None = None,
    interpret: bool = False,
):
    """(o [B, H, V] in v's dtype, new conv window [B, T-1, 3, H, K], new state [B, H, K, V] fp32 in place of the
    donated state): `reference.kda_decode_fused`. Tiles: None from `tuned.DECODE_FUSED_GPU` (block_v: the value
    columns of one step of a program's walk over its state)."""
    tiles = tiles or lookup(tuned.DECODE_FUSED_GPU, dtype=v_BHV.dtype)
    batch, heads, key_dim = q_BHK.shape
    value_dim = v_BHV.shape[-1]
    if value_dim != key_dim:
        raise ValueError(f"kda_decode_fused: the conv window holds q, k and v rows alike: V {value_dim} != K {key_dim}")
    block_v = min(tiles.block_v, value_dim)
    window = conv_window_BW3HK.shape[1]
    taps = weights.conv_q_HKT.shape[-1]
    row = pl.BlockSpec((None, None, key_dim), lambda h, b: (b, h, 0))
    per_head = pl.BlockSpec((None, key_dim, taps), lambda h, b: (h, 0, 0))
    window_block = pl.BlockSpec((None, window, 3, None, key_dim), lambda h, b: (b, 0, 0, h, 0))
    state_block = pl.BlockSpec((None, None, key_dim, value_dim), lambda h, b: (b, h, 0, 0))
    scalar = pl.BlockSpec((None, None), lambda h, b: (b, h))
    per_sequence = pl.BlockSpec((None,), lambda h, b: (b,))
    weight_specs = [per_head] * 3 + [
        pl.BlockSpec((None, key_dim), lambda h, b: (h, 0)),
        pl.BlockSpec((None,), lambda h, b: (h,)),
        pl.BlockSpec((value_dim,), lambda h, b: (0,)),
    ]
    kernel = functools.partial(_fused_kernel, scale=scale, lower_bound=lower_bound, eps=eps, block_v=block_v)
    return pl.pallas_call(
        kernel,
        grid=(heads, batch),
        in_specs=[row] * 4 + [scalar, row, window_block, state_block] + weight_specs + [per_sequence],
        out_specs=[row, window_block, state_block],
        out_shape=[
            jax.ShapeDtypeStruct(v_BHV.shape, v_BHV.dtype),
            jax.ShapeDtypeStruct(conv_window_BW3HK.shape, conv_window_BW3HK.dtype),
            jax.ShapeDtypeStruct(state_BHKV.shape, jnp.float32),
        ],
        input_output_aliases={7: 2},
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret,
        name="kda_decode_fused",
    )(
        q_BHK,
        k_BHK,
        v_BHV,
        f_BHK,
        b_BH,
        gate_BHV,
        conv_window_BW3HK,
        state_BHKV.astype(jnp.float32),
        *jax.tree.leaves(weights),
        jnp.ones(batch, jnp.int32) if real_B is None else real_B.astype(jnp.int32),
    )
