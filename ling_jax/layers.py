"""Primitive layers shared by every block: a bias-free linear map and the two RMSNorms.

Weights keep the checkpoint's [out, in] layout, so loading a tensor never transposes it. Every parameter
carries its logical axis names (`out_sharding` metadata, e.g. ("experts", "expert_mlp", "embed")); the
mesh axes they map to are chosen once, in `ling_jax.sharding`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.norm.ops import add_rms_norm, rms_norm
from pallas_kernels.norm.reference import rms_normalize

DEFAULT_INIT_STD = 0.02


def param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """A parameter annotated with one logical axis name per dimension (sharding is applied later, explicitly)."""
    if len(axes) != value.ndim:
        raise ValueError(f"{len(axes)} logical axes {axes} for a parameter of shape {value.shape}")
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, axes: tuple[str | None, ...],
                 std: float = DEFAULT_INIT_STD) -> nnx.Param:
    return param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype), axes)


class Linear(nnx.Module):
    """y = x @ weight.T with weight [out_features, in_features], no bias (no Ling projection has one)."""

    def __init__(self, in_features: int, out_features: int, *, axes: tuple[str | None, str | None], dtype,
                 rngs: nnx.Rngs):
        """axes: logical names of (out_features, in_features)."""
        self.weight = normal_param(rngs, (out_features, in_features), dtype, axes)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...i,oi->...o", x, self.weight[...].astype(x.dtype))


class RMSNorm(nnx.Module):
    """weight * (x / rms(x)): normalised in fp32, cast back to the input dtype, then scaled (spec §5).
    backend: `pallas_kernels.norm` (one kernel per norm on a GPU, the jnp reference elsewhere)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = param(jnp.ones((dim,), dtype), ("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array, *, backend: str = "reference") -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps, backend=backend)

    def add_and_normalize(self, x: jax.Array, residual: jax.Array, *, backend: str = "reference"):
        """(x + residual, this norm of it), one kernel on a GPU."""
        return add_rms_norm(x, residual, self.weight[...], self.eps, backend=backend)


class GatedRMSNorm(nnx.Module):
    """KDA output norm: (x / rms(x)) * weight * sigmoid(gate), entirely in fp32, then cast (spec §2 step 8)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = param(jnp.ones((dim,), dtype), ("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        normed = rms_normalize(x.astype(jnp.float32), self.eps) * self.weight[...].astype(jnp.float32)
        return (normed * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)
