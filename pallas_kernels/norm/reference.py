"""RMSNorm in pure jnp, the spec in code (spec §5): weight * (x / rms(x)), normalised in fp32, cast back to
the input dtype, then scaled in that dtype; and the residual add in front of it (of a product, or of a split-K
product's partial sums)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_normalize(x_f32: jax.Array, eps: float) -> jax.Array:
    return x_f32 * jax.lax.rsqrt(jnp.mean(jnp.square(x_f32), axis=-1, keepdims=True) + eps)


def rms_norm_reference(x, weight, eps: float) -> jax.Array:
    """[..., D] in x's dtype."""
    normed = rms_normalize(x.astype(jnp.float32), eps).astype(x.dtype)
    return weight.astype(x.dtype) * normed


def add_rms_norm_reference(x, residual, weight, eps: float):
    """(x + residual, rms_norm(x + residual)), both in x's dtype: a decoder layer's residual add and the norm
    after it."""
    total = x + residual.astype(x.dtype)
    return total, rms_norm_reference(total, weight, eps)


def add_partials_rms_norm_reference(x, partials_SND, weight, eps: float):
    """`add_rms_norm_reference` of x [..., D] and the sum of fp32 partial sums [S, N, D] (N = x's rows, a split-K
    product's partials) cast to x's dtype."""
    y = jnp.sum(partials_SND, axis=0).astype(x.dtype).reshape(x.shape)
    return add_rms_norm_reference(x, y, weight, eps)
