"""Kimi Delta Attention layer (spec §2): projections, short causal convs, gates, delta rule, gated norm.

Padding: a token whose mask is 0 contributes nothing. Its gate is forced to 0 and beta to 0 (an identity
state update), and the short convs run over each row's real tokens only (pads are moved out of the way, so
pads may sit anywhere, not just on the left).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.cache import KDAState
from ling_jax.config import LingConfig
from ling_jax.layers import GatedRMSNorm, Linear, param
from pallas_kernels.kda.ops import chunk_kda, kda_decode_step
from pallas_kernels.kda.reference import kda_recurrent

CHUNKED = "chunked"
RECURRENT = "recurrent"
STEPS = "steps"  # recurrent, keeping the state after every token (speculative-decoding verification)


def causal_conv_silu(u_BTC, window_BWC, weight_CK, mask_BT):
    """Depthwise causal conv (no bias) + SiLU over [window ; u], skipping masked tokens.

    Returns (y [B, T, C] in u's dtype, new window [B, K-1, C]: the newest K-1 real inputs).
    """
    taps = weight_CK.shape[-1]
    length = u_BTC.shape[1]
    full = jnp.concatenate([window_BWC.astype(u_BTC.dtype), u_BTC], axis=1)  # [B, K-1+T, C]
    if mask_BT is not None:
        # stable-sort pads to the front: [pads, window, real tokens], so each real token sees real history
        real = jnp.concatenate([jnp.ones(window_BWC.shape[:2], bool), mask_BT.astype(bool)], axis=1)
        order = jnp.argsort(real, axis=1, stable=True)
        full = jnp.take_along_axis(full, order[..., None], axis=1)
    padded = jnp.pad(full.astype(jnp.float32), ((0, 0), (taps - 1, 0), (0, 0)))
    y = sum(padded[:, j:j + full.shape[1]] * weight_CK[:, j].astype(jnp.float32) for j in range(taps))
    y = jax.nn.silu(y).astype(u_BTC.dtype)
    if mask_BT is not None:
        y = jnp.take_along_axis(y, jnp.argsort(order, axis=1)[..., None], axis=1)
    return y[:, -length:], full[:, full.shape[1] - (taps - 1):]


def step_windows(window_BWC, u_BTC):
    """[B, T, K-1, C]: the conv window (newest K-1 inputs) after each of the T tokens, all real."""
    taps_minus_one = window_BWC.shape[1]
    full = jnp.concatenate([window_BWC.astype(u_BTC.dtype), u_BTC], axis=1)
    return jnp.stack([full[:, t + 1:t + 1 + taps_minus_one] for t in range(u_BTC.shape[1])], axis=1)


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

    def _forget_and_output_gate_inputs(self, x_BTD):
        if self.config.no_kda_lora:
            return self.f_proj(x_BTD), self.g_proj(x_BTD)
        return self.f_b_proj(self.f_a_proj(x_BTD)), self.g_b_proj(self.g_a_proj(x_BTD))

    def log_decay(self, f_BTC) -> jax.Array:
        """g [B, T, H, d] fp32: the safe gate lower_bound * sigmoid(A a) or -A softplus(a), a = f + dt_bias."""
        c = self.config
        a = f_BTC.astype(jnp.float32) + self.dt_bias[...]
        a = a.reshape(*a.shape[:2], c.num_attention_heads, c.head_dim)
        decay_rate = jnp.exp(self.A_log[...])[:, None]
        if c.kda_safe_gate:
            return c.kda_lower_bound * jax.nn.sigmoid(decay_rate * a)
        return -decay_rate * jax.nn.softplus(a)

    def __call__(self, x_BTD, state: KDAState, mask_BT=None, *, mode: str = CHUNKED, chunk_size: int = 64,
                 kernel_backend: str = "reference"):
        """x [B, T, D] (the input_layernorm output) -> (y [B, T, D], updated state).

        Chunked mode runs `pallas_kernels.kda.chunk_kda`, a one-token recurrent step
        `pallas_kernels.kda.kda_decode_step`, both with `kernel_backend`. Steps mode returns a state per token
        (conv_window [B, T, K-1, 3C], recurrent_state [B, T, H, d, d]) for speculative verification.
        """
        c = self.config
        batch, length, _ = x_BTD.shape
        heads, head_dim, width = c.num_attention_heads, c.head_dim, c.kda_dim
        mixed = jnp.concatenate([self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)], axis=-1)
        conv_w = jnp.concatenate([self.q_conv1d[...], self.k_conv1d[...], self.v_conv1d[...]], axis=0)
        if mask_BT is not None:
            mixed = jnp.where(mask_BT[..., None], mixed, 0)
        if mode == STEPS and mask_BT is not None:
            raise ValueError(f"KDA mode {STEPS!r} takes no padding mask: every verified token is real")
        conv_inputs_BTC = mixed
        mixed, window = causal_conv_silu(conv_inputs_BTC, state.conv_window, conv_w, mask_BT)
        q, k, v = (t.reshape(batch, length, heads, head_dim) for t in jnp.split(mixed, 3, axis=-1))
        f, r = self._forget_and_output_gate_inputs(x_BTD)
        g = self.log_decay(f)
        beta = jax.nn.sigmoid(self.b_proj(x_BTD).astype(jnp.float32))
        if mask_BT is not None:
            g = jnp.where(mask_BT[..., None, None], g, 0.0)
            beta = jnp.where(mask_BT[..., None], beta, 0.0)
        if mode == CHUNKED:
            o, recurrent = chunk_kda(q, k, v, g, beta, initial_state=state.recurrent_state, chunk_size=chunk_size,
                                     backend=kernel_backend)
        elif mode == RECURRENT and length == 1:
            o, recurrent = kda_decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state.recurrent_state,
                                           backend=kernel_backend)
            o = o[:, None]
        elif mode == RECURRENT:
            o, recurrent = kda_recurrent(q, k, v, g, beta, initial_state=state.recurrent_state)
        elif mode == STEPS:
            o, recurrent = kda_recurrent(q, k, v, g, beta, initial_state=state.recurrent_state,
                                         return_all_states=True)
            window = step_windows(state.conv_window, conv_inputs_BTC)
        else:
            raise ValueError(f"KDA mode must be {CHUNKED!r}, {RECURRENT!r} or {STEPS!r}, got {mode!r}")
        o = self.o_norm(o, r.reshape(batch, length, heads, head_dim))
        y = self.dense(o.reshape(batch, length, width))
        return y, KDAState(conv_window=window.astype(state.conv_window.dtype), recurrent_state=recurrent)
