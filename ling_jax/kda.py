"""Kimi Delta Attention layer (spec §2): projections, short causal convs, gates, delta rule, gated norm.

`kda_attention(weights, x_BTD, state, ctx, cfg)` is the layer as a pure function; `KimiDeltaAttention` holds
the parameters and calls it.

Padding: a token whose mask is 0 contributes nothing. Its gate is forced to 0 and beta to 0 (an identity
state update), and the short convs run over each row's real tokens only (pads are moved out of the way, so
pads may sit anywhere, not just on the left); in steps mode the state after a pad is the one before it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.cache import KDAState
from ling_jax.config import LingConfig
from ling_jax.context import TokenContext
from ling_jax.layers import (
    GatedNormInput,
    GatedRMSNorm,
    Linear,
    Weights,
    gated_rms_norm,
    linear,
    linear_many,
    param,
    params_of,
)
from ling_jax.policy import ExecutionPolicy, KDADecode, KDAMode, as_policy, op_backend
from ling_jax.sharding import per_shard
from pallas_kernels.backend import KERNEL_TARGET, resolve_backend
from pallas_kernels.fp8 import GatedHeadNorm
from pallas_kernels.kda.ops import (
    chunk_kda,
    fused_decode_leaves_norm,
    kda_decode_fused,
    kda_decode_step,
    kda_verify_fused,
    short_conv_silu,
)
from pallas_kernels.kda.reference import BetaProjection, DecodeWeights, kda_log_decay, kda_recurrent

CHUNKED = KDAMode.CHUNKED
RECURRENT = KDAMode.RECURRENT
STEPS = KDAMode.STEPS  # recurrent, keeping the state after every token (speculative-decoding verification)
DEFAULT_CHUNK_SIZE = 64
JOINED_CONV_TOKENS = 8  # up to this many tokens a call the short convs run over a joined copy (`_joined_conv`)

# logical axes of the kernels' arrays: each sequence and each head is independent (`per_shard`)
_BTHD = ("activation_batch", None, "heads", None)
_BTH = ("activation_batch", None, "heads")
_BHD = ("activation_batch", "heads", None)
_BH = ("activation_batch", "heads")
_BHKV = ("activation_batch", "heads", None, None)
_WINDOW = ("activation_batch", None, None, "heads", None)  # the conv window [B, K-1, 3, H, d]
_STEP_WINDOWS = ("activation_batch", None, None, None, "heads", None)  # steps mode's windows [B, T, K-1, 3, H, d]
_STEP_STATES = ("activation_batch", None, "heads", None, None)  # steps mode's states [B, T, H, d, d]
_BTD = ("activation_batch", None, None)  # the layer input [B, T, D]
_BTC = ("activation_batch", None, "heads")  # q, k or v before the conv [B, T, C]
_WINDOW_PARTS = ("activation_batch", None, None, "heads")  # the conv window as [B, K-1, 3, C]
_CONV_WEIGHTS = (None, "heads", None)  # the q, k, v conv weights [3, C, K]
_HD = ("heads", None)  # b_proj's weight [H, D]
_HDK = ("heads", None, None)  # a conv weight [H, d, K]; its first two axes: dt_bias [H, d]; its first: A_log [H]


def step_windows(window_BWC, u_BTC, mask_BT=None):
    """[B, T, K-1, C]: the conv window (newest K-1 real inputs) after each of the T tokens; a pad (mask_BT false)
    leaves it as it was."""
    window_BWC = window_BWC.astype(u_BTC.dtype)
    windows = []
    for t in range(u_BTC.shape[1]):
        shifted_BWC = jnp.concatenate([window_BWC[:, 1:], u_BTC[:, t : t + 1]], axis=1)
        window_BWC = shifted_BWC if mask_BT is None else jnp.where(mask_BT[:, t, None, None], shifted_BWC, window_BWC)
        windows.append(window_BWC)
    return jnp.stack(windows, axis=1)


def _conv(qkv, window_BWC, conv_w_3CK, mask_BT, policy: ExecutionPolicy):
    """(q, k, v [B, T, C] after the short convs + SiLU, the new window [B, K-1, 3C]) over a chunk: the parts read
    where they lie (`pallas_kernels.kda.ops.short_conv_silu`, on a GPU one kernel), each device its own heads."""
    batch, length, width = qkv[0].shape
    taps = conv_w_3CK.shape[-1]
    real_BT = jnp.ones((batch, length), bool) if mask_BT is None else mask_BT

    def conv(q, k, v, window_BW3C, weight_3CK, real_BT):  # one device's heads
        ys, window = short_conv_silu(
            [q, k, v],
            window_BW3C.reshape(*window_BW3C.shape[:2], -1),
            weight_3CK.reshape(-1, taps),
            real_BT,
            backend=op_backend(policy),
        )
        return (*ys, window.reshape(window_BW3C.shape))

    *convolved, window = per_shard(
        conv,
        in_axes=(_BTC,) * 3 + (_WINDOW_PARTS, _CONV_WEIGHTS, _BTH[:2]),
        out_axes=(_BTC,) * 3 + (_WINDOW_PARTS,),
    )(*qkv, window_BWC.reshape(batch, taps - 1, 3, width), conv_w_3CK, real_BT)
    return convolved, window.reshape(window_BWC.shape)


def _joined_conv(qkv, window_BWC, conv_w_3CK, mask_BT):
    """`_conv`'s outputs for a few tokens (a decode step, a verify pass): over one joined copy [B, K-1+T, 3C] of
    the window and q, k, v, the pads stably sorted to its front, then shifted slices. The copy (a gather when pads
    are possible) is what lets XLA update a donated window in place: a fusion reading the window shifted while
    writing it would need a copy of it first."""
    joined_BTC = jnp.concatenate(qkv, axis=-1)
    weight_CK = conv_w_3CK.reshape(-1, conv_w_3CK.shape[-1])
    taps, length = weight_CK.shape[-1], joined_BTC.shape[1]
    full_BFC = jnp.concatenate([window_BWC.astype(joined_BTC.dtype), joined_BTC], axis=1)
    if mask_BT is not None:  # [pads (zeroed), window, real tokens]: each real token sees real history
        full_BFC = jnp.where(jnp.pad(mask_BT, ((0, 0), (taps - 1, 0)), constant_values=True)[..., None], full_BFC, 0)
        real_BF = jnp.concatenate([jnp.ones(window_BWC.shape[:2], bool), mask_BT.astype(bool)], axis=1)
        order_BF = jnp.argsort(real_BF, axis=1, stable=True)
        full_BFC = jnp.take_along_axis(full_BFC, order_BF[..., None], axis=1)
    padded_BFC = jnp.pad(full_BFC.astype(jnp.float32), ((0, 0), (taps - 1, 0), (0, 0)))
    width = full_BFC.shape[1]
    y = sum(padded_BFC[:, tap : tap + width] * weight_CK[:, tap].astype(jnp.float32) for tap in range(taps))
    y = jax.nn.silu(y).astype(joined_BTC.dtype)
    if mask_BT is not None:  # back to the tokens' order; the pads' outputs (over pads and zeros) are 0
        y = jnp.take_along_axis(y, jnp.argsort(order_BF, axis=1)[..., None], axis=1)
    return jnp.split(y[:, -length:], 3, axis=-1), full_BFC[:, width - (taps - 1) :]


def _projections(weights: Weights, x_BTD, config: LingConfig, policy: ExecutionPolicy, *, beta: bool = True):
    """(q, k, v [B, T, C], the beta logits [B, T, H] (None when not `beta`), the forget-gate and output-gate
    pre-activations [B, T, C]): the projections of x in one `linear_many` (the block-FP8 ones in one kernel on a
    GPU decode step), then the gates' low-rank second halves where the layer has them."""
    gates = ("f_proj", "g_proj") if config.no_kda_lora else ("f_a_proj", "g_a_proj")
    names = ("q_proj", "k_proj", "v_proj", *(("b_proj",) if beta else ()), *gates)
    q, k, v, *rest = linear_many([weights[name] for name in names], x_BTD, policy)
    b = rest.pop(0) if beta else None
    f, r = rest
    if not config.no_kda_lora:
        f, r = linear(weights["f_b_proj"], f, policy), linear(weights["g_b_proj"], r, policy)
    return q, k, v, b, f, r


def log_decay(weights: Weights, f_BTC, cfg: LingConfig) -> jax.Array:
    """g [B, T, H, d] fp32: the safe gate lower_bound * sigmoid(A a) or -A softplus(a), a = f + dt_bias."""
    heads, head_dim = cfg.num_attention_heads, cfg.head_dim
    f_BTHD = f_BTC.reshape(*f_BTC.shape[:2], heads, head_dim)
    return kda_log_decay(f_BTHD, weights["dt_bias"].reshape(heads, head_dim), weights["A_log"], gate_lower_bound(cfg))


def gate_lower_bound(cfg: LingConfig) -> float | None:
    """The bound every log-decay of `log_decay` keeps (g > it): the safe gate's kda_lower_bound, None without the
    safe gate (-A softplus(a) has none). The prefill picks its kernel by it (`pallas_kernels.kda.ops.chunk_variant`:
    the bounded kernels from -5 up, the any-gate ones below or without a bound)."""
    return cfg.kda_lower_bound if cfg.kda_safe_gate else None


def fused_decode(policy: ExecutionPolicy) -> bool:
    """Whether a recurrent one-token step runs fused (`pallas_kernels.kda.kda_decode_fused`), and steps mode too
    (`kda_verify_fused`, the same over a verify pass's tokens): kda_decode FUSED, or AUTO with a GPU's kernels (one
    kernel a layer: the convs, gates, recurrence and, at batches that fill the SMs, the gated norm; the separate ops
    launch about seven, steps mode's jnp ones many more)."""
    if policy.kda_decode == KDADecode.AUTO:
        return KERNEL_TARGET.get(resolve_backend(op_backend(policy))) == "gpu"
    return policy.kda_decode == KDADecode.FUSED


def kda_attention(
    weights: Weights,
    x_BTD,
    state: KDAState | None,
    ctx: TokenContext,
    cfg: LingConfig,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    project_output: bool = True,
):
    """The KDA layer: x [B, T, D] (the input_layernorm output) -> (y [B, T, D], updated state).

    weights: the layer's `attention` parameters (`q_proj`, `q_conv1d`, `A_log`, ...); state None starts from
    zeros. ctx gives the padding mask, the mode and the kernel backend (`ctx.policy`). project_output False: the
    output projection's input o [B, T, C] in y's place, for the caller to project (`layers.linear_add_rms_norm`):
    where the fused decode (or verify) step on one device leaves the gated output norm to a kernel of its own, o
    before the norm with it (`layers.GatedNormInput`), for the projection's gemv to form as it reads o.
    """
    if state is None:
        state = KDAState.zeros(cfg, x_BTD.shape[0], x_BTD.dtype)
    return _kda(
        weights,
        x_BTD,
        state,
        ctx.mask_BT,
        cfg,
        chunk_size=chunk_size,
        policy=ctx.policy,
        project_output=project_output,
    )


def _kda(
    weights: Weights,
    x_BTD,
    state: KDAState,
    mask_BT,
    config: LingConfig,
    *,
    chunk_size: int,
    policy: ExecutionPolicy,
    project_output: bool = True,
):
    c = config
    mode = policy.kda_mode
    batch, length, _ = x_BTD.shape
    if (mode == STEPS or mode == RECURRENT and length == 1) and fused_decode(policy):
        return _fused(weights, x_BTD, state, mask_BT, c, policy, project_output)
    heads, head_dim, width = c.num_attention_heads, c.head_dim, c.kda_dim
    *qkv, b, f, r = _projections(weights, x_BTD, c, policy)
    conv_w = jnp.stack([weights["q_conv1d"], weights["k_conv1d"], weights["v_conv1d"]])
    if mode == STEPS or length <= JOINED_CONV_TOKENS:
        convolved, window = _joined_conv(qkv, state.conv_window, conv_w, mask_BT)
    else:
        convolved, window = _conv(qkv, state.conv_window, conv_w, mask_BT, policy)
    q, k, v = (t.reshape(batch, length, heads, head_dim) for t in convolved)
    g = log_decay(weights, f, c)
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    if mask_BT is not None:
        g = jnp.where(mask_BT[..., None, None], g, 0.0)
        beta = jnp.where(mask_BT[..., None], beta, 0.0)
    if mode == CHUNKED:
        bound = gate_lower_bound(c)
        chunked = functools.partial(
            chunk_kda,
            chunk_size=chunk_size,
            # unbounded gates as a bound of -inf: a bounded kernel named by policy.kda_prefill is refused
            gate_lower_bound=-math.inf if bound is None else bound,
            backend=op_backend(policy),
            variant=policy.kda_prefill,
            segments=policy.kda_segments,
        )
        o, recurrent = per_shard(
            lambda q, k, v, g, beta, s: chunked(q, k, v, g, beta, initial_state=s),
            in_axes=(_BTHD,) * 4 + (_BTH, _BHKV),
            out_axes=(_BTHD, _BHKV),
        )(q, k, v, g, beta, state.recurrent_state)
    elif mode == RECURRENT and length == 1:
        o, recurrent = per_shard(
            functools.partial(kda_decode_step, backend=op_backend(policy)),
            in_axes=(_BHD,) * 4 + (_BH, _BHKV),
            out_axes=(_BHD, _BHKV),
        )(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state.recurrent_state)
        o = o[:, None]
    elif mode == RECURRENT:
        o, recurrent = kda_recurrent(q, k, v, g, beta, initial_state=state.recurrent_state)
    elif mode == STEPS:
        o, recurrent = kda_recurrent(q, k, v, g, beta, initial_state=state.recurrent_state, return_all_states=True)
        window = step_windows(state.conv_window, jnp.concatenate(qkv, axis=-1), mask_BT)
    else:
        valid = ", ".join(repr(m.value) for m in KDAMode)
        raise ValueError(f"KDA mode must be one of {valid}, got {mode!r}")
    o = gated_rms_norm(weights["o_norm"], o, r.reshape(batch, length, heads, head_dim), c.rms_norm_eps)
    o_BTC = o.reshape(batch, length, width)
    y = linear(weights["dense"], o_BTC, policy) if project_output else o_BTC
    return y, KDAState(conv_window=window.astype(state.conv_window.dtype), recurrent_state=recurrent)


def _fused(
    weights: Weights,
    x_BTD,
    state: KDAState,
    mask_BT,
    config: LingConfig,
    policy: ExecutionPolicy,
    project_output: bool,
):
    """`_kda` for one token per sequence in recurrent mode, or steps mode's few tokens, everything between the
    projections in one op (`pallas_kernels.kda.kda_decode_fused`, `kda_verify_fused`: one kernel on a GPU), as
    `fused_decode` asks; o left unnormalised for the caller where that saves a kernel (`kda_attention`'s
    project_output)."""
    c = config
    steps = policy.kda_mode == STEPS
    batch, length, _ = x_BTD.shape
    heads, head_dim = c.num_attention_heads, c.head_dim
    one_device = jax.sharding.get_abstract_mesh().empty
    defer_norm = (
        not project_output
        and one_device
        and fused_decode_leaves_norm(batch, heads, head_dim, x_BTD.dtype, backend=op_backend(policy))
    )

    def per_head(t):
        return t.reshape(batch, length, heads, head_dim)

    b_weight = weights["b_proj"]["weight"]
    project_beta = isinstance(b_weight, jax.Array) and one_device
    q, k, v, b, f, r = _projections(weights, x_BTD, c, policy, beta=not project_beta)
    window = state.conv_window.reshape(batch, c.short_conv_kernel_size - 1, 3, heads, head_dim)
    conv = [weights[name].reshape(heads, head_dim, -1) for name in ("q_conv1d", "k_conv1d", "v_conv1d")]
    layer = (*conv, weights["dt_bias"].reshape(heads, head_dim), weights["A_log"], weights["o_norm"]["weight"])
    real_BT = jnp.ones((batch, length), bool) if mask_BT is None else mask_BT
    # beta's logits, or (a plain b_proj on one device) the layer input and b_proj for the kernel to project
    beta_inputs, beta_axes = ((x_BTD, b_weight), (_BTD, _HD)) if project_beta else ((b,), (_BTH,))

    def fused(q, k, v, f, r, window, recurrent, *arrays):
        b = BetaProjection(*arrays[7:]) if project_beta else arrays[7]
        keywords = dict(
            lower_bound=gate_lower_bound(c), eps=c.rms_norm_eps, output_norm=not defer_norm, backend=op_backend(policy)
        )
        if steps:
            return kda_verify_fused(
                q, k, v, f, b, r, window, recurrent, DecodeWeights(*arrays[:6]), real_BT=arrays[6], **keywords
            )
        b = BetaProjection(b.x_BD[:, 0], b.weight_HD) if project_beta else b[:, 0]
        one_token = (x[:, 0] for x in (q, k, v, f))
        o, window, recurrent = kda_decode_fused(
            *one_token,
            b,
            r[:, 0],
            window,
            recurrent,
            DecodeWeights(*arrays[:6]),
            real_B=arrays[6][:, 0],
            **keywords,
        )
        return o[:, None], window, recurrent

    o, window, recurrent = per_shard(
        fused,
        in_axes=(_BTHD,) * 5 + (_WINDOW, _BHKV) + (_HDK,) * 3 + (_HDK[:2], _HDK[:1], None, _BTH[:2]) + beta_axes,
        out_axes=(_BTHD, _STEP_WINDOWS, _STEP_STATES) if steps else (_BTHD, _WINDOW, _BHKV),
    )(*(per_head(t) for t in (q, k, v, f, r)), window, state.recurrent_state, *layer, real_BT, *beta_inputs)
    o_BTC = o.reshape(batch, length, c.kda_dim)
    if defer_norm:
        o_BTC = GatedNormInput(o_BTC, GatedHeadNorm(r, weights["o_norm"]["weight"], c.rms_norm_eps))
    y = linear(weights["dense"], o_BTC, policy) if project_output else o_BTC
    window_shape = (batch, length, *state.conv_window.shape[1:]) if steps else state.conv_window.shape
    return y, KDAState(conv_window=window.reshape(window_shape), recurrent_state=recurrent)


class KimiDeltaAttention(nnx.Module):
    def __init__(self, config: LingConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        hidden, width, heads, taps = c.hidden_size, c.kda_dim, c.num_attention_heads, c.short_conv_kernel_size
        self.q_proj = Linear(hidden, width, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        self.k_proj = Linear(hidden, width, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        self.v_proj = Linear(hidden, width, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        bound = 1.0 / math.sqrt(taps)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):  # [C, K], fp32 as in both references
            conv_CK = jax.random.uniform(rngs.params(), (width, taps), jnp.float32, -bound, bound)
            setattr(self, name, param(conv_CK, ("heads", "conv_taps")))
        if c.no_kda_lora:
            self.f_proj = Linear(hidden, width, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
            self.g_proj = Linear(hidden, width, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        else:
            self.f_a_proj = Linear(hidden, c.head_dim, axes=("kda_lora", "embed"), dtype=dtype, rngs=rngs)
            self.f_b_proj = Linear(c.head_dim, width, axes=("heads", "kda_lora"), dtype=dtype, rngs=rngs)
            self.g_a_proj = Linear(hidden, c.head_dim, axes=("kda_lora", "embed"), dtype=dtype, rngs=rngs)
            self.g_b_proj = Linear(c.head_dim, width, axes=("heads", "kda_lora"), dtype=dtype, rngs=rngs)
        self.b_proj = Linear(hidden, heads, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        self.A_log = param(jnp.log(jax.random.uniform(rngs.params(), (heads,), jnp.float32, 1.0, 16.0)), ("heads",))
        dt = jnp.exp(jax.random.uniform(rngs.params(), (width,), jnp.float32, math.log(1e-3), math.log(1e-1)))
        self.dt_bias = param(dt + jnp.log(-jnp.expm1(-dt)), ("heads",))  # inverse softplus of dt
        self.o_norm = GatedRMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype)
        self.dense = Linear(width, hidden, axes=("embed", "heads"), dtype=dtype, rngs=rngs)

    def __call__(
        self,
        x_BTD,
        state: KDAState,
        mask_BT=None,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        policy: ExecutionPolicy | None = None,
    ):
        """x [B, T, D] (the input_layernorm output) -> (y [B, T, D], updated state); `kda_attention` with the
        mask given directly.

        The mode is the policy's (None: `ExecutionPolicy()`), or per call if it has none (`ExecutionPolicy.for_call`:
        recurrent for one token, chunked otherwise). Chunked mode runs `pallas_kernels.kda.chunk_kda`, a one-token
        recurrent step `pallas_kernels.kda.kda_decode_step`, both with the policy's kernel backend. Steps mode
        returns a state per token (conv_window [B, T, K-1, 3C], recurrent_state [B, T, H, d, d]) for speculative
        verification.
        """
        return _kda(
            params_of(self),
            x_BTD,
            state,
            mask_BT,
            self.config,
            chunk_size=chunk_size,
            policy=as_policy(policy).for_call(x_BTD.shape[1], cached=True),
        )
