"""Kimi Delta Attention in pure jnp: the step-by-step recurrence and the chunked form (spec §2).

Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] log-decay (<= 0); beta [B, T, H];
state [B, H, K, V] fp32. Everything is computed in fp32; outputs are cast back to v's dtype.
A token with g = 0 and beta = 0 leaves the state unchanged, which is how padding is expressed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.norm.reference import rms_normalize

L2_EPS = 1e-6


def l2_normalize(x: jax.Array) -> jax.Array:
    """x / sqrt(sum(x^2) + 1e-6) over the last axis (the eps sits inside the sqrt, as in FLA)."""
    return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + L2_EPS)


def _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm):
    batch, _, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * (key_dim**-0.5 if scale is None else scale)
    if initial_state is None:
        initial_state = jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32)
    return q, k, v, g, beta, initial_state.astype(jnp.float32)


def kda_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=True, return_all_states=False):
    """One token at a time: S <- diag(e^g) S; S <- S + k beta (v - S^T k)^T; o = S^T q. Returns (o, S).

    return_all_states: S is then [B, T, H, K, V], the state after each token (for speculative decoding,
    which commits the state at the last accepted draft token). Its loop is unrolled: the verify pass's few
    positions then run as straight-line code, no loop trips in the decode program (benchmarks.op_census).
    """
    out_dtype = v.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm)

    def step(S_BHKV, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        S_BHKV = S_BHKV * jnp.exp(g_t)[..., None]
        delta_BHV = b_t[..., None] * (v_t - jnp.einsum("bhkv,bhk->bhv", S_BHKV, k_t))
        S_BHKV = S_BHKV + k_t[..., None] * delta_BHV[..., None, :]
        o_BHV = jnp.einsum("bhkv,bhk->bhv", S_BHKV, q_t)
        return S_BHKV, (o_BHV, S_BHKV) if return_all_states else o_BHV

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)]
    state, per_step = jax.lax.scan(step, state, time_major, unroll=return_all_states)
    if return_all_states:
        o_TBHV, states_TBHKV = per_step
        return jnp.moveaxis(o_TBHV, 0, 1).astype(out_dtype), jnp.moveaxis(states_TBHKV, 0, 1)
    return jnp.moveaxis(per_step, 0, 1).astype(out_dtype), state


LEAF = 16  # diagonal blocks of this size are inverted by forward substitution


def _forward_substitution(L_CC):
    """(I + L)^-1 for strictly lower-triangular L [..., C, C], a row at a time: row c of the inverse is
    e_c - sum_j L[c, j] (row j of the inverse). A loop, not unrolled: small programs compile fast."""
    size = L_CC.shape[-1]
    eye = jnp.eye(size, dtype=L_CC.dtype)

    def row(c, inverse):
        return inverse.at[..., c, :].set(eye[c] - jnp.einsum("...j,...jk->...k", L_CC[..., c, :], inverse))

    return jax.lax.fori_loop(1, size, row, jnp.broadcast_to(eye, L_CC.shape))


def unit_lower_inverse(L_CC):
    """(I + L)^-1 for strictly lower-triangular L [..., C, C], by blocks: all LEAF-row diagonal blocks at once
    by forward substitution, then pairs merged level by level, [[A', 0], [-D' B A', D']] being the inverse of
    [[I + A, 0], [B, I + D]] for A' = (I + A)^-1, D' = (I + D)^-1. C is padded to LEAF x 2^n with zeros
    (which leaves the leading block of the inverse unchanged).

    Every intermediate is a block of the true inverse, whose entries stay bounded for the delta rule's L
    (|L| <= 1), so this is accurate in fp32 and tf32. A power series in L is not: L^k holds binomial-sized
    entries (about 1e17 for a 64-row chunk of equal keys) that cancel only in exact arithmetic. A triangular
    solve is avoided too: jaxlib 0.10's batched CPU solve (and its gradient) can deadlock in its thread pool.
    """
    size = L_CC.shape[-1]
    if size <= LEAF:
        return _forward_substitution(L_CC)
    width, blocks = LEAF, 1 << (-(-size // LEAF) - 1).bit_length()
    padded = blocks * width
    L = jnp.pad(L_CC, [(0, 0)] * (L_CC.ndim - 2) + [(0, padded - size), (0, padded - size)])
    diagonal = jnp.stack([L[..., i * width : (i + 1) * width, i * width : (i + 1) * width] for i in range(blocks)])
    inverses = list(_forward_substitution(diagonal))
    while len(inverses) > 1:
        merged = []
        for pair in range(0, len(inverses), 2):
            start = pair * width
            top, bottom = inverses[pair], inverses[pair + 1]
            lower_left = -bottom @ (L[..., start + width : start + 2 * width, start : start + width] @ top)
            zeros = jnp.zeros_like(top)
            merged.append(
                jnp.concatenate(
                    [jnp.concatenate([top, zeros], axis=-1), jnp.concatenate([lower_left, bottom], axis=-1)], axis=-2
                )
            )
        inverses, width = merged, 2 * width
    return inverses[0][..., :size, :size]


def kda_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=True, chunk_size=64):
    """The chunked (WY) form, scanning over chunks of `chunk_size` tokens. Returns (o, S).

    Inside a chunk with cumulative log-decay G_c, only exponentials of differences G_c - G_j <= 0 and of
    G_c itself are formed, so a gate at the safe bound (-5) over 64 steps cannot overflow fp32.
    """
    out_dtype = v.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm)
    batch, length, heads, key_dim = q.shape
    pad = -length % chunk_size
    if pad:
        q, k, v, g = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v, g))
        beta = jnp.pad(beta, ((0, 0), (0, pad), (0, 0)))
    num_chunks = (length + pad) // chunk_size

    def to_chunks(x):  # [B, T, H, ...] -> [N, B, H, C, ...]
        x = x.reshape(batch, num_chunks, chunk_size, heads, *x.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)

    causal_CC = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    strict_CC = jnp.tril(jnp.ones((chunk_size, chunk_size), bool), -1)

    def chunk(S_BHKV, xs):
        q_c, k_c, v_c, g_c, b_c = xs  # [B, H, C, K|V], b_c [B, H, C]
        G = jnp.cumsum(g_c, axis=-2)  # [B, H, C, K]
        diff = G[..., :, None, :] - G[..., None, :, :]  # [B, H, C(c), C(j), K]
        decay = jnp.exp(jnp.where(causal_CC[..., None], diff, -jnp.inf))
        kk = jnp.einsum("bhck,bhjk,bhcjk->bhcj", k_c, k_c, decay)
        L = b_c[..., None] * jnp.where(strict_CC, kk, 0.0)
        # T = (I + L)^-1 diag(beta), applied to both right-hand sides
        inverse = unit_lower_inverse(L)
        W = jnp.einsum("bhcj,bhjk->bhck", inverse, b_c[..., None] * (jnp.exp(G) * k_c))
        U = jnp.einsum("bhcj,bhjv->bhcv", inverse, b_c[..., None] * v_c)
        V_new = U - jnp.einsum("bhck,bhkv->bhcv", W, S_BHKV)
        M = jnp.einsum("bhck,bhjk,bhcjk->bhcj", q_c, k_c, decay)
        o = jnp.einsum("bhck,bhkv->bhcv", q_c * jnp.exp(G), S_BHKV) + jnp.einsum("bhcj,bhjv->bhcv", M, V_new)
        G_last = G[..., -1:, :]  # [B, H, 1, K]
        S_BHKV = jnp.exp(G_last[..., 0, :])[..., None] * S_BHKV + jnp.einsum(
            "bhck,bhcv->bhkv", jnp.exp(G_last - G) * k_c, V_new
        )
        return S_BHKV, o

    xs = (to_chunks(q), to_chunks(k), to_chunks(v), to_chunks(g), to_chunks(beta[..., None])[..., 0])
    state, o_NBHCV = jax.lax.scan(chunk, state, xs)
    o = jnp.moveaxis(o_NBHCV, 0, 1)  # [B, N, H, C, V]
    o = jnp.moveaxis(o, 2, 3).reshape(batch, num_chunks * chunk_size, heads, -1)[:, :length]
    return o.astype(out_dtype), state


def kda_log_decay(f_BHK, dt_bias_HK, a_log_H, lower_bound: float | None) -> jax.Array:
    """g fp32 from the forget gate's pre-activation f [..., H, K]: the safe gate lower_bound * sigmoid(e^A_log a),
    or -e^A_log softplus(a) for lower_bound None, a = f + dt_bias."""
    a = f_BHK.astype(jnp.float32) + dt_bias_HK
    decay_rate_H1 = jnp.exp(a_log_H)[:, None]
    if lower_bound is not None:
        return lower_bound * jax.nn.sigmoid(decay_rate_H1 * a)
    return -decay_rate_H1 * jax.nn.softplus(a)


def conv_sources(real_BT, lag: int) -> tuple[jax.Array, jax.Array]:
    """Where each token's short-conv inputs sit, as positions in [window ; tokens] (the window's `lag` entries at
    0..lag-1, all real; token t at lag+t; pads skipped): ([lag, B, T] int32: row l, each token's (l+1)-th latest real
    input before it; [B, lag] the new window's, oldest first: the latest `lag` real inputs of all)."""
    batch, length = real_BT.shape
    real_BF = jnp.concatenate([jnp.ones((batch, lag), bool), real_BT.astype(bool)], axis=1)
    latest_BF = jax.lax.cummax(jnp.where(real_BF, jnp.arange(lag + length), -1), axis=1)  # newest real at or before
    before_BF = jnp.concatenate([jnp.full((batch, 1), -1, latest_BF.dtype), latest_BF[:, :-1]], axis=1)
    lags, newest = [before_BF[:, lag:]], [latest_BF[:, -1:]]
    for _ in range(lag - 1):
        lags.append(jnp.take_along_axis(before_BF, lags[-1], axis=1))
        newest.append(jnp.take_along_axis(before_BF, newest[-1], axis=1))
    return jnp.stack(lags).astype(jnp.int32), jnp.concatenate(newest[::-1], axis=1).astype(jnp.int32)


def conv_inputs_at(u_BTC, window_BWC, position_BT):
    """[B, T, C]: the inputs at positions of [window ; u] (`conv_sources`), gathered from each without joining them."""
    lag = window_BWC.shape[1]
    from_u = jnp.take_along_axis(u_BTC, jnp.maximum(position_BT - lag, 0)[..., None], axis=1)
    from_window = jnp.take_along_axis(window_BWC, jnp.minimum(position_BT, lag - 1)[..., None], axis=1)
    return jnp.where((position_BT < lag)[..., None], from_window, from_u)


def conv_windows(parts_BTC, window_BWC, newest_BW) -> jax.Array:
    """The new conv window [B, K-1, sum C_i] in the parts' dtype: each part's inputs at the newest_BW positions
    (`conv_sources`), side by side."""
    window_BWC, start, windows = window_BWC.astype(parts_BTC[0].dtype), 0, []
    for u_BTC in parts_BTC:
        windows.append(conv_inputs_at(u_BTC, window_BWC[..., start : start + u_BTC.shape[-1]], newest_BW))
        start += u_BTC.shape[-1]
    return jnp.concatenate(windows, axis=-1)


def short_conv_silu(parts_BTC, window_BWC, weight_CK, real_BT, positions_LBT) -> list[jax.Array]:
    """KDA's depthwise causal convs (no bias) + SiLU of each part (q, k, v: [B, T, C_i]) over [window ; part], the
    parts' channels side by side in window [B, K-1, sum C_i] and weight [sum C_i, K]: a real token's conv sees its K-1
    latest real inputs (positions_LBT from `conv_sources(real_BT)`), in fp32; a pad's output is 0. Returns [y
    [B, T, C_i] in the parts' dtype for each part]. Each part is read where it lies (no joined copy)."""
    lag = weight_CK.shape[-1] - 1
    window_BWC, ys, start = window_BWC.astype(parts_BTC[0].dtype), [], 0
    for u_BTC in parts_BTC:
        part = slice(start, start + u_BTC.shape[-1])
        start = part.stop
        window_part_BWC, weight_part_CK = window_BWC[..., part], weight_CK[part].astype(jnp.float32)
        inputs = [conv_inputs_at(u_BTC, window_part_BWC, positions_LBT[lag - 1 - tap]) for tap in range(lag)]
        # oldest input first: tap j weighs the input lag - j real tokens back
        y = sum(x.astype(jnp.float32) * weight_part_CK[:, tap] for tap, x in enumerate([*inputs, u_BTC]))
        ys.append(jnp.where(real_BT[..., None], jax.nn.silu(y).astype(u_BTC.dtype), 0))
    return ys


def gated_output_norm(o, gate, weight, eps: float) -> jax.Array:
    """KDA's output norm over the last axis: (o / rms(o)) * weight * sigmoid(gate), in fp32, cast to o's dtype."""
    normed = rms_normalize(o.astype(jnp.float32), eps) * weight.astype(jnp.float32)
    return (normed * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(o.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeWeights:
    """The weights of a KDA layer that its fused decode step reads (`kda_decode_fused`): the short convs' [H, K, T]
    (q, k, v), the forget gate's dt_bias [H, K] and A_log [H], the output norm's weight [V]."""

    conv_q_HKT: jax.Array
    conv_k_HKT: jax.Array
    conv_v_HKT: jax.Array
    dt_bias_HK: jax.Array
    a_log_H: jax.Array
    norm_weight_V: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BetaProjection:
    """Beta's pre-activation as the projection that forms it (the model's b_proj), for `kda_decode_fused` to form
    itself: b [B, H] = x [B, D] @ weight [H, D]^T, the weight cast to x's dtype, the products summed in fp32 and
    rounded to x's dtype."""

    x_BD: jax.Array
    weight_HD: jax.Array


def beta_logits(b) -> jax.Array:
    """b [B, H]: as given, or formed from a `BetaProjection`."""
    if isinstance(b, BetaProjection):
        x_BD, weight_HD = b.x_BD, b.weight_HD.astype(b.x_BD.dtype)
        return jnp.einsum("bd,hd->bh", x_BD, weight_HD, preferred_element_type=jnp.float32).astype(x_BD.dtype)
    return b


def kda_decode_fused(
    q_BHK,
    k_BHK,
    v_BHV,
    f_BHK,
    b_BH,
    gate_BHV,
    conv_window_BW3HK,
    state_BHKV,
    weights,
    *,
    real_B=None,
    scale=None,
    lower_bound,
    eps,
    output_norm=True,
):
    """A KDA layer's decode step between its projections, one token per sequence: (o [B, H, V] in v's dtype,
    new conv window, new state [B, H, K, V] fp32); output_norm False: o before the gated output norm, for the caller
    to apply (`gated_output_norm`) or fuse into its next kernel.

    q, k, v: the projections before the short convs (V == K); conv_window [B, T-1, 3, H, K]: the last T-1 of them ([q;
    k; v], oldest first); f: the forget gate's pre-activation (g = `kda_log_decay`, lower_bound: the safe gate's bound,
    None for -A softplus); b: beta's (beta = sigmoid(b)), or a `BetaProjection` forming it; gate: the output gate's
    (`gated_output_norm` with eps); weights: `DecodeWeights`; real_B [B] bool: False for a pad token (None: all real),
    whose convs give 0 and whose g and beta are 0, so that its o is 0 and its window and state stay as they were; scale:
    of q (None: K^-1/2). Each short conv's output is SiLU'd and rounded to v's dtype, then q and k are L2-normalised and
    the step runs as `kda_recurrent`, its output rounded to v's dtype before the norm: the model's separate ops, in
    order, a padding mask included.
    """
    real_B = jnp.ones(q_BHK.shape[0], bool) if real_B is None else real_B
    real_B11, real_B111 = real_B[:, None, None], real_B[:, None, None, None]
    u_B3HK = jnp.stack([q_BHK, k_BHK, v_BHV], axis=1)
    full_BT3HK = jnp.concatenate([conv_window_BW3HK.astype(u_B3HK.dtype), u_B3HK[:, None]], axis=1)
    weight_3HKT = jnp.stack([weights.conv_q_HKT, weights.conv_k_HKT, weights.conv_v_HKT]).astype(jnp.float32)
    taps = weight_3HKT.shape[-1]
    conv_B3HK = sum(full_BT3HK[:, j].astype(jnp.float32) * weight_3HKT[..., j] for j in range(taps))
    q, k, v = jnp.unstack(jnp.where(real_B111, jax.nn.silu(conv_B3HK), 0).astype(u_B3HK.dtype), axis=1)
    g = jnp.where(real_B11, kda_log_decay(f_BHK, weights.dt_bias_HK, weights.a_log_H, lower_bound), 0.0)
    beta = jnp.where(real_B[:, None], jax.nn.sigmoid(beta_logits(b_BH).astype(jnp.float32)), 0.0)
    o, state = kda_recurrent(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], scale=scale, initial_state=state_BHKV
    )
    new_window = jnp.where(real_B111[..., None], full_BT3HK[:, 1:], full_BT3HK[:, :-1]).astype(conv_window_BW3HK.dtype)
    o_BHV = gated_output_norm(o[:, 0], gate_BHV, weights.norm_weight_V, eps) if output_norm else o[:, 0]
    return o_BHV, new_window, state


def kda_verify_fused(
    q_BTHK,
    k_BTHK,
    v_BTHV,
    f_BTHK,
    b_BTH,
    gate_BTHV,
    conv_window_BW3HK,
    state_BHKV,
    weights,
    *,
    real_BT=None,
    scale=None,
    lower_bound,
    eps,
    output_norm=True,
):
    """`kda_decode_fused` over T tokens a row in turn, keeping what each leaves (speculative verification): (o [B, T,
    H, V] in v's dtype, the conv window [B, T, W, 3, H, K] and state [B, T, H, K, V] fp32 after each token). The
    arrays are `kda_decode_fused`'s with a token axis after the batch's (b_BTH: beta's pre-activations or a
    `BetaProjection` of x [B, T, D]); real_BT [B, T] bool: False for a pad token (None: all real); output_norm as
    there."""
    outputs, windows, states = [], [], []
    for t in range(q_BTHK.shape[1]):
        b_BH = BetaProjection(b_BTH.x_BD[:, t], b_BTH.weight_HD) if isinstance(b_BTH, BetaProjection) else b_BTH[:, t]
        o_BHV, conv_window_BW3HK, state_BHKV = kda_decode_fused(
            *(x[:, t] for x in (q_BTHK, k_BTHK, v_BTHV, f_BTHK)),
            b_BH,
            gate_BTHV[:, t],
            conv_window_BW3HK,
            state_BHKV,
            weights,
            real_B=None if real_BT is None else real_BT[:, t],
            scale=scale,
            lower_bound=lower_bound,
            eps=eps,
            output_norm=output_norm,
        )
        outputs.append(o_BHV)
        windows.append(conv_window_BW3HK)
        states.append(state_BHKV)
    return jnp.stack(outputs, axis=1), jnp.stack(windows, axis=1), jnp.stack(states, axis=1)
