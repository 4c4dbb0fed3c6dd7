"""A KDA layer's decode step between its projections in one Pallas kernel (Triton lowering): short convs, gates,
L2 norms, the recurrence and the gated output norm (`reference.kda_decode_fused`, in the same order and
roundings).

Grid (value splits, heads, batch), the splits fastest: program (s, h, b) owns value columns [s BV, (s + 1) BV) of
sequence-head (b, h), BV = V / splits. It convolves the head's whole q and k rows with their conv windows (every
program of the head does: the rows are tiny), and its own columns of v; forms g and beta from their
pre-activations; walks its [K, BV] slice of the head's fp32 state block_v columns at a time (S <- diag(e^g) S;
S <- S + k beta (v - S^T k)^T; o = S^T q), writing it back over the input (aliased: no program reads another's
columns); and writes its columns of the shifted conv windows. Splitting V fills the SMs at small batch (32
sequence-heads at batch 1 on 132 SMs: `value_splits`), each program streaming a quarter of a state. Beta's
pre-activation comes as b [B, H], or as the layer's input row and b_proj's weight (`BetaProjection`), whose dot
each program forms over D in power-of-two pieces (the model's b_proj, without an XLA kernel of its own).

The gated output norm needs the head's whole output row: with one split the program normalises it itself (the
step is one kernel); with more the kernel writes o before the norm (rounded to v's dtype, as the model's ops
round it) and `reference.gated_output_norm` follows in XLA (one small fusion), or, asked for o without its norm
(output_norm False: `leaves_norm` says where), in the caller's next kernel (the output projection's gemv prologue,
`pallas_kernels.fp8.GatedHeadNorm`). The windows are written out of
place: every program of a head reads the head's whole q and k window rows, which another program's shifted
columns would overwrite.

The same kernel runs a speculative verify pass's T tokens a row (`kda_verify_fused_gpu`, `reference.
kda_verify_fused`): each program takes the row's tokens in turn, its conv window rows rolled in registers (a pad's
leaves them), each [K, block_v] state block loaded once and updated T times, and writes each token's output,
window and state ([B, T, H, K, V] fp32: fresh outputs, the input state kept). A decode step is its T = 1 with the
last state only, written over the input.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda import tuned
from pallas_kernels.kda.reference import L2_EPS, BetaProjection, DecodeWeights, gated_output_norm
from pallas_kernels.kda.step_math import delta_rule_update
from pallas_kernels.tuning import lookup

Q, K, V = 0, 1, 2  # the conv window's [q; k; v] rows
H200_SMS = 132  # the SMs `value_splits` fills where no GPU is attached (a program lowered for CUDA on a CPU)
MIN_SPLIT_COLUMNS = 16  # the narrowest state slice a program owns
MAX_DOT_COLUMNS = 1024  # beta's projection: x and the weight row this many columns at a time at most


def value_splits(sequence_heads: int, value_dim: int, cores: int) -> int:
    """Programs a sequence-head: the largest power of two whose programs (sequence_heads x splits) still fit on
    `cores` SMs at once, each owning >= MIN_SPLIT_COLUMNS value columns (1 when the sequence-heads fill the SMs)."""
    splits = 1
    while sequence_heads * splits * 2 <= cores and value_dim % (splits * 2 * MIN_SPLIT_COLUMNS) == 0:
        splits *= 2
    return splits


def _conv_inputs(window_rows, inputs, reals):
    """(for each token, its short conv's inputs: the window before it, oldest first, then its own row; the window
    after each token, a pad's as it was)."""
    conv_inputs, windows = [], []
    for u, real in zip(inputs, reals):
        conv_inputs.append([*window_rows, u])
        window_rows = [jnp.where(real, new, old) for new, old in zip([*window_rows[1:], u], window_rows)]
        windows.append(window_rows)
    return conv_inputs, windows


def _conv_silu(rows, weight_ref, columns, real):
    """The short conv + SiLU of one token's conv inputs (`_conv_inputs`) over `columns` of the weight, rounded to
    the rows' dtype then fp32 as the model's ops are (0 for a pad token)."""
    conv = sum(row.astype(jnp.float32) * weight_ref[columns, j].astype(jnp.float32) for j, row in enumerate(rows))
    return jnp.where(real, jax.nn.silu(conv).astype(rows[-1].dtype).astype(jnp.float32), 0.0)


def _beta_inputs(b_refs, token):
    """The loads of beta's pre-activation for one token (`_beta_logit` reduces them): b's element, or the pieces of
    x and the weight row (`BetaProjection`) over D in power-of-two pieces."""
    if len(b_refs) == 1:
        return [(b_refs[0][token], None)]
    x_ref, weight_ref = b_refs
    width = x_ref.shape[-1]
    piece = min(width & -width, MAX_DOT_COLUMNS)  # the largest power of two dividing D
    return [(x_ref[token, pl.ds(start, piece)], weight_ref[pl.ds(start, piece)]) for start in range(0, width, piece)]


def _beta_logit(inputs):
    """Beta's pre-activation in fp32 from `_beta_inputs`: b's element, or x . weight row (the weight in x's dtype,
    the products summed in fp32, rounded to x's dtype)."""
    (b, weight), *_ = inputs
    if weight is None:
        return b.astype(jnp.float32)
    total = sum(jnp.sum(x.astype(jnp.float32) * w.astype(x.dtype)) for x, w in inputs)
    return total.astype(b.dtype).astype(jnp.float32)


def _l2_normalized(x_K):
    return x_K * jax.lax.rsqrt(jnp.sum(x_K * x_K) + L2_EPS)


def _fused_kernel(
    q_ref,
    k_ref,
    v_ref,
    f_ref,
    gate_ref,
    window_ref,
    own_window_ref,
    q_own_ref,
    k_own_ref,
    state_ref,
    *refs,
    scale,
    lower_bound,
    eps,
    block_v,
    normalize,
    beta_inputs,
    all_states,
):
    """Program (split, head, sequence): its convs, gates, state columns and output columns (module docstring) for
    each of the row's T tokens in turn (the token rows' first axis). refs: the `DecodeWeights`, real, beta's inputs
    (b, or x and b_proj's weight row: beta_inputs of them), then the outputs: o, and the window and state after each
    token (all_states: their first axis the token's) or after the last."""
    conv_q_ref, conv_k_ref, conv_v_ref, dt_bias_ref, a_log_ref, norm_weight_ref, real_ref = refs[:7]
    b_refs = refs[7 : 7 + beta_inputs]
    o_ref, new_window_ref, new_state_ref = refs[7 + beta_inputs :]
    dtype = v_ref.dtype
    tokens, window = q_ref.shape[0], own_window_ref.shape[0]
    value_dim = state_ref.shape[1]  # the program's columns
    reals = [real_ref[t] != 0 for t in range(tokens)]
    stored = range(tokens) if all_states else (tokens - 1,)  # the tokens whose window and state are written

    def at(t):  # where token t's window and state go in the outputs
        return (t,) if all_states else ()

    def conv_inputs(window_ref, which, u_ref, columns):
        rows = [window_ref[j, which, columns].astype(dtype) for j in range(window)]
        return _conv_inputs(rows, [u_ref[t, columns].astype(dtype) for t in range(tokens)], reals)

    def column_block(start):
        """The loads of one block of the program's value columns: its state slice and its values' conv inputs."""
        columns = pl.ds(start, block_v)
        return state_ref[:, columns], conv_inputs(own_window_ref, V, v_ref, columns)[0]

    # Every load the first column block needs is issued before the first cross-thread sum (a barrier, which loads
    # are not moved across): the state slice first, the longest wait.
    first_block = column_block(0)
    q_inputs, _ = conv_inputs(window_ref, Q, q_ref, slice(None))
    k_inputs, _ = conv_inputs(window_ref, K, k_ref, slice(None))
    a_rows = [f_ref[t, :].astype(jnp.float32) for t in range(tokens)]
    beta_inputs = [_beta_inputs(b_refs, t) for t in range(tokens)]
    qs = [_l2_normalized(_conv_silu(rows, conv_q_ref, slice(None), r)) * scale for rows, r in zip(q_inputs, reals)]
    ks = [_l2_normalized(_conv_silu(rows, conv_k_ref, slice(None), r)) for rows, r in zip(k_inputs, reals)]
    for which, u_ref in zip((Q, K, V), (q_own_ref, k_own_ref, v_ref)):
        _, windows = conv_inputs(own_window_ref, which, u_ref, slice(None))
        for t in stored:
            for j, row in enumerate(windows[t]):
                new_window_ref[(*at(t), j, which, slice(None))] = row.astype(new_window_ref.dtype)
    decay_rate = jnp.exp(a_log_ref[...])
    decays, betas = [], []
    for t, real in enumerate(reals):
        a_K = a_rows[t] + dt_bias_ref[...]
        if lower_bound is None:
            g_K = -decay_rate * jax.nn.softplus(a_K)
        else:
            g_K = lower_bound * jax.nn.sigmoid(decay_rate * a_K)
        decays.append(jnp.where(real, jnp.exp(g_K), 1.0))
        betas.append(jnp.where(real, jax.nn.sigmoid(_beta_logit(beta_inputs[t])), 0.0))
    outputs = [[] for _ in range(tokens)]
    for start in range(0, value_dim, block_v):
        columns = pl.ds(start, block_v)
        state_KV, v_inputs = first_block if start == 0 else column_block(start)
        for t in range(tokens):
            v_V = _conv_silu(v_inputs[t], conv_v_ref, columns, reals[t])
            state_KV = state_KV * decays[t][:, None]
            state_KV = delta_rule_update(state_KV, ks[t], v_V, betas[t])
            outputs[t].append(jnp.sum(qs[t][:, None] * state_KV, axis=0).astype(dtype))
            if t in stored:
                new_state_ref[(*at(t), slice(None), columns)] = state_KV
    for t, token_outputs in enumerate(outputs):
        if not normalize:
            for start, o_V in zip(range(0, value_dim, block_v), token_outputs):
                o_ref[t, pl.ds(start, block_v)] = o_V.astype(o_ref.dtype)
            continue
        token_outputs = [o_V.astype(jnp.float32) for o_V in token_outputs]
        inverse_rms = jax.lax.rsqrt(sum(jnp.sum(o_V * o_V) for o_V in token_outputs) / value_dim + eps)
        for start, o_V in zip(range(0, value_dim, block_v), token_outputs):
            columns = pl.ds(start, block_v)
            weight_V = norm_weight_ref[columns].astype(jnp.float32)
            gate_V = jax.nn.sigmoid(gate_ref[t, columns].astype(jnp.float32))
            o_ref[t, columns] = (o_V * inverse_rms * weight_V * gate_V).astype(o_ref.dtype)


def _cores(interpret: bool) -> int:
    if not interpret and jax.default_backend() == "gpu":
        return getattr(jax.devices()[0], "core_count", None) or H200_SMS
    return H200_SMS


def _splits(batch: int, heads: int, value_dim: int, tiles: tuned.DecodeFusedGpuTiles, interpret: bool) -> int:
    return tiles.value_splits or value_splits(batch * heads, value_dim, _cores(interpret))


def leaves_norm(
    batch: int, heads: int, value_dim: int, dtype, *, tiles: tuned.DecodeFusedGpuTiles | None = None, interpret: bool
) -> bool:
    """Whether the kernel, for batch x heads sequence-heads of value_dim values in dtype, splits the values (tiles:
    None from `tuned.DECODE_FUSED_GPU`) and so leaves the gated output norm to a kernel after it."""
    return _splits(batch, heads, value_dim, tiles or lookup(tuned.DECODE_FUSED_GPU, dtype=dtype), interpret) > 1


def _fused_call(
    q_BTHK,
    k_BTHK,
    v_BTHV,
    f_BTHK,
    b_BTH,
    gate_BTHV,
    conv_window_BW3HK,
    state_BHKV,
    weights: DecodeWeights,
    real_BT,
    *,
    scale: float,
    lower_bound: float | None,
    eps: float,
    tiles: tuned.DecodeFusedGpuTiles | None,
    interpret: bool,
    all_states: bool,
    output_norm: bool = True,
):
    """The kernel over T tokens a row: (o [B, T, H, V], the windows and states after each token (all_states: [B, T,
    W, 3, H, K], [B, T, H, K, V] fp32) or after the last ([B, W, 3, H, K], [B, H, K, V] fp32 in place of the
    state)); output_norm False: o before the gated output norm."""
    tiles = tiles or lookup(tuned.DECODE_FUSED_GPU, dtype=v_BTHV.dtype)
    batch, tokens, heads, key_dim = q_BTHK.shape
    value_dim = v_BTHV.shape[-1]
    if value_dim != key_dim:
        raise ValueError(f"kda_decode_fused: the conv window holds q, k and v rows alike: V {value_dim} != K {key_dim}")
    splits = _splits(batch, heads, value_dim, tiles, interpret)
    if value_dim % splits:
        raise ValueError(f"kda_decode_fused: tiles.value_splits {splits} does not divide V {value_dim}")
    split_dim = value_dim // splits
    block_v = min(tiles.block_v, split_dim)
    if split_dim % block_v:
        raise ValueError(f"kda_decode_fused: tiles.block_v {block_v} does not divide V / value_splits {split_dim}")
    window = conv_window_BW3HK.shape[1]
    taps = weights.conv_q_HKT.shape[-1]
    row = pl.BlockSpec((None, tokens, None, key_dim), lambda s, h, b: (b, 0, h, 0))
    own_row = pl.BlockSpec((None, tokens, None, split_dim), lambda s, h, b: (b, 0, h, s))
    conv = pl.BlockSpec((None, key_dim, taps), lambda s, h, b: (h, 0, 0))
    own_conv = pl.BlockSpec((None, split_dim, taps), lambda s, h, b: (h, s, 0))
    window_block = pl.BlockSpec((None, window, 3, None, key_dim), lambda s, h, b: (b, 0, 0, h, 0))
    own_window = pl.BlockSpec((None, window, 3, None, split_dim), lambda s, h, b: (b, 0, 0, h, s))
    own_state = pl.BlockSpec((None, None, key_dim, split_dim), lambda s, h, b: (b, h, 0, s))
    weight_specs = [
        conv,
        conv,
        own_conv,
        pl.BlockSpec((None, key_dim), lambda s, h, b: (h, 0)),
        pl.BlockSpec((None,), lambda s, h, b: (h,)),
        pl.BlockSpec((split_dim,), lambda s, h, b: (s,)),
    ]
    if isinstance(b_BTH, BetaProjection):
        width = b_BTH.x_BD.shape[-1]
        beta_inputs = [b_BTH.x_BD, b_BTH.weight_HD]
        beta_specs = [
            pl.BlockSpec((None, tokens, width), lambda s, h, b: (b, 0, 0)),
            pl.BlockSpec((None, width), lambda s, h, b: (h, 0)),
        ]
    else:
        beta_inputs, beta_specs = [b_BTH], [pl.BlockSpec((None, tokens, None), lambda s, h, b: (b, 0, h))]
    in_specs = [row, row, own_row, row, own_row, window_block, own_window, own_row, own_row, own_state]
    in_specs += [*weight_specs, pl.BlockSpec((None, tokens), lambda s, h, b: (b, 0)), *beta_specs]
    window_shape, state_shape = conv_window_BW3HK.shape, state_BHKV.shape
    if all_states:
        own_window = pl.BlockSpec((None, tokens, window, 3, None, split_dim), lambda s, h, b: (b, 0, 0, 0, h, s))
        own_state = pl.BlockSpec((None, tokens, None, key_dim, split_dim), lambda s, h, b: (b, 0, h, 0, s))
        window_shape = (batch, tokens, *window_shape[1:])
        state_shape = (batch, tokens, *state_shape[1:])
    normalize = splits == 1 and output_norm
    kernel = functools.partial(
        _fused_kernel,
        scale=scale,
        lower_bound=lower_bound,
        eps=eps,
        block_v=block_v,
        normalize=normalize,
        beta_inputs=len(beta_inputs),
        all_states=all_states,
    )
    o, new_window, new_state = pl.pallas_call(
        kernel,
        grid=(splits, heads, batch),  # axis 0 varies fastest: a head's programs run together
        in_specs=in_specs,
        out_specs=[own_row, own_window, own_state],
        out_shape=[
            jax.ShapeDtypeStruct(v_BTHV.shape, v_BTHV.dtype),
            jax.ShapeDtypeStruct(window_shape, conv_window_BW3HK.dtype),
            jax.ShapeDtypeStruct(state_shape, jnp.float32),
        ],
        input_output_aliases={} if all_states else {9: 2},
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret,
        name="kda_verify_fused" if all_states else "kda_decode_fused",
    )(
        q_BTHK,
        k_BTHK,
        v_BTHV,
        f_BTHK,
        gate_BTHV,
        conv_window_BW3HK,
        conv_window_BW3HK,
        q_BTHK,
        k_BTHK,
        state_BHKV.astype(jnp.float32),
        *jax.tree.leaves(weights),
        jnp.ones((batch, tokens), jnp.int32) if real_BT is None else real_BT.astype(jnp.int32),
        *beta_inputs,
    )
    if output_norm and not normalize:
        o = gated_output_norm(o, gate_BTHV, weights.norm_weight_V, eps)
    return o, new_window, new_state


@functools.partial(
    jax.jit,
    static_argnames=("scale", "lower_bound", "eps", "tiles", "interpret", "output_norm"),
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
    tiles: tuned.DecodeFusedGpuTiles | None = None,
    interpret: bool = False,
    output_norm: bool = True,
):
    """(o [B, H, V] in v's dtype, new conv window [B, T-1, 3, H, K], new state [B, H, K, V] fp32 in place of the
    donated state): `reference.kda_decode_fused` (b_BH: beta's pre-activation, or a `BetaProjection` that each
    program forms its element of; output_norm False: o before the gated output norm). Tiles: None from
    `tuned.DECODE_FUSED_GPU` (value_splits: the programs a sequence-head, None for `value_splits`' rule; block_v: the
    value columns of one step of a program's walk over its state slice)."""
    one_token = [x[:, None] for x in (q_BHK, k_BHK, v_BHV, f_BHK)]
    if isinstance(b_BH, BetaProjection):
        b_BTH = BetaProjection(b_BH.x_BD[:, None], b_BH.weight_HD)
    else:
        b_BTH = b_BH[:, None]
    o_BTHV, window, state = _fused_call(
        *one_token,
        b_BTH,
        gate_BHV[:, None],
        conv_window_BW3HK,
        state_BHKV,
        weights,
        None if real_B is None else real_B[:, None],
        scale=scale,
        lower_bound=lower_bound,
        eps=eps,
        tiles=tiles,
        interpret=interpret,
        all_states=False,
        output_norm=output_norm,
    )
    return o_BTHV[:, 0], window, state


@functools.partial(jax.jit, static_argnames=("scale", "lower_bound", "eps", "tiles", "interpret", "output_norm"))
def kda_verify_fused_gpu(
    q_BTHK,
    k_BTHK,
    v_BTHV,
    f_BTHK,
    b_BTH,
    gate_BTHV,
    conv_window_BW3HK,
    state_BHKV,
    weights: DecodeWeights,
    *,
    real_BT=None,
    scale: float,
    lower_bound: float | None,
    eps: float,
    tiles: tuned.DecodeFusedGpuTiles | None = None,
    interpret: bool = False,
    output_norm: bool = True,
):
    """(o [B, T, H, V] in v's dtype, the conv window [B, T, W, 3, H, K] and state [B, T, H, K, V] fp32 after each
    token): `reference.kda_verify_fused`, T decode steps in one kernel (each program keeps its state columns on chip
    over the T tokens); b_BTH: beta's pre-activations, or a `BetaProjection` of x [B, T, D]. Tiles and output_norm as
    for `kda_decode_fused_gpu`."""
    return _fused_call(
        q_BTHK,
        k_BTHK,
        v_BTHV,
        f_BTHK,
        b_BTH,
        gate_BTHV,
        conv_window_BW3HK,
        state_BHKV,
        weights,
        real_BT,
        scale=scale,
        lower_bound=lower_bound,
        eps=eps,
        tiles=tiles,
        interpret=interpret,
        all_states=True,
        output_norm=output_norm,
    )
