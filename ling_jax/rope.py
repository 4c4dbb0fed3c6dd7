"""Rotary embeddings of the MLA rope dims: plain, YaRN (spec §3.2, §3.3) and the softmax scale (§3.5)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.config import LingConfig, RopeConfig
from ling_jax.mrope import mrope_angles


def yarn_mscale(factor: float, mu: float) -> float:
    """m(s, mu) of spec §3.3."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mu * math.log(factor) + 1.0


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, original_max: int) -> float:
    return dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def inv_frequencies(rope: RopeConfig, rope_dim: int) -> np.ndarray:
    """inv_freq [rope_dim / 2] in float64, YaRN-blended when the config asks for it."""
    exponents = np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim
    inv_freq = rope.theta**-exponents
    if not rope.is_yarn:
        return inv_freq
    lo = _yarn_correction_dim(rope.beta_fast, rope_dim, rope.theta, rope.original_max_position_embeddings)
    hi = _yarn_correction_dim(rope.beta_slow, rope_dim, rope.theta, rope.original_max_position_embeddings)
    if rope.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rope_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
    keep = (1.0 - ramp) * rope.extrapolation_factor
    return inv_freq * (keep + (1.0 - keep) / rope.factor)


def cos_sin_factor(rope: RopeConfig) -> float:
    """YaRN's multiplier on cos and sin: m(f, mscale) / m(f, mscale_all_dim) * attn_factor (SGLang's text rule);
    with 3-axis sections (the VL model) SGLang's mRoPE rule, m(f, 1) * attn_factor (spec §3.3)."""
    if not rope.is_yarn:
        return 1.0
    if rope.mrope_section is not None:
        return yarn_mscale(rope.factor, 1.0) * rope.attn_factor
    mscale = 1.0 if rope.mscale is None else rope.mscale
    mscale_all_dim = 0.0 if rope.mscale_all_dim is None else rope.mscale_all_dim
    return yarn_mscale(rope.factor, mscale) / yarn_mscale(rope.factor, mscale_all_dim) * rope.attn_factor


def softmax_scale(config: LingConfig) -> float:
    """1/sqrt(qk_nope + qk_rope), times m(f, mscale_all_dim)^2 only when mscale_all_dim is set."""
    scale = config.qk_head_dim**-0.5
    rope = config.rope
    if rope.is_yarn and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


def rope_cos_sin(positions: jax.Array, config: LingConfig) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, rope_dim / 2] in fp32 for integer positions [B, T], or 3-axis (t, h, w) positions
    [B, T, 3] of the VL model (each frequency rotated by its axis' position, `ling_jax.mrope`)."""
    inv_freq = jnp.asarray(inv_frequencies(config.rope, config.qk_rope_head_dim), jnp.float32)
    if positions.ndim == 3:
        angles = mrope_angles(positions, inv_freq, config.rope.mrope_section)
    else:
        angles = positions.astype(jnp.float32)[..., None] * inv_freq
    factor = cos_sin_factor(config.rope)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rope(x: jax.Array, cos_BTF: jax.Array, sin_BTF: jax.Array, *, interleave: bool) -> jax.Array:
    """Rotate x [B, T, ..., rope_dim]; pairs are (2i, 2i+1) if interleave else (i, i + rope_dim/2).

    The rotated pair is written back where it came from, so cached rope keys keep the input layout.
    """
    extra = x.ndim - cos_BTF.ndim
    cos = cos_BTF.reshape(cos_BTF.shape[:2] + (1,) * extra + cos_BTF.shape[2:])
    sin = sin_BTF.reshape(cos.shape)
    xf = x.astype(jnp.float32)
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        rotated = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
    else:
        x1, x2 = jnp.split(xf, 2, axis=-1)
        rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
