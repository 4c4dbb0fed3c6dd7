"""Primitive layers shared by every block: a bias-free linear map and the two RMSNorms.

Weights keep the checkpoint's [out, in] layout, so loading a tensor never transposes it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

DEFAULT_INIT_STD = 0.02


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = DEFAULT_INIT_STD) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


class Linear(nnx.Module):
    """y = x @ weight.T with weight [out_features, in_features], no bias (no Ling projection has one)."""

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs):
        self.weight = normal_param(rngs, (out_features, in_features), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...i,oi->...o", x, self.weight[...].astype(x.dtype))


def rms_normalize(x_f32: jax.Array, eps: float) -> jax.Array:
    return x_f32 * jax.lax.rsqrt(jnp.mean(jnp.square(x_f32), axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """weight * (x / rms(x)): normalised in fp32, cast back to the input dtype, then scaled (spec §5)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        normed = rms_normalize(x.astype(jnp.float32), self.eps).astype(x.dtype)
        return self.weight[...].astype(x.dtype) * normed


class GatedRMSNorm(nnx.Module):
    """KDA output norm: (x / rms(x)) * weight * sigmoid(gate), entirely in fp32, then cast (spec §2 step 8)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        normed = rms_normalize(x.astype(jnp.float32), self.eps) * self.weight[...].astype(jnp.float32)
        return (normed * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)
