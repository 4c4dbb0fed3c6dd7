"""Primitive layers shared by every block: a bias-free linear map and the two RMSNorms, each a pure function of
its weights (`linear`, `linear_many`, `rms_norm`, `add_rms_norm`, `linear_add_rms_norm`, `gated_rms_norm`) and a
module that calls it.

Weights keep the checkpoint's [out, in] layout, so loading a tensor never transposes it. Every parameter
carries its logical axis names (`out_sharding` metadata, e.g. ("experts", "expert_mlp", "embed")); the
mesh axes they map to are chosen once, in `ling_jax.sharding`. A `quantizable` parameter (a projection's
weight, the routed experts) may hold a quantised weight (`ling_jax.quantized`) that its layer dequantises
inside the step, or a block-FP8 weight goes to the FP8 kernels (`project`), multiplied as the policy's
`fp8_matmul` says: the layers take the `ExecutionPolicy` and pass it down to every projection.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.policy import ExecutionPolicy, FP8Matmul, KernelBackend, as_policy, op_backend
from ling_jax.quantized import BlockFP8Weight, dequantized
from ling_jax.sharding import ACTIVATION_BTD, constrain, per_shard
from pallas_kernels.fp8 import GatedHeadNorm, fp8_linear, fp8_linear_many, fp8_linear_partials
from pallas_kernels.fp8.reference import gated_head_norm
from pallas_kernels.norm.ops import add_partials_rms_norm as add_partials_rms_norm_op
from pallas_kernels.norm.ops import add_rms_norm as add_rms_norm_op
from pallas_kernels.norm.ops import rms_norm as rms_norm_op
from pallas_kernels.norm.reference import rms_normalize

DEFAULT_INIT_STD = 0.02

Weights = dict  # a layer's parameters as a nested dict of arrays, keyed like the checkpoint's tensor names


def params_of(module: nnx.Module) -> Weights:
    """The module's parameters as a nested dict of arrays (the `weights` argument of its function)."""
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def project(x: jax.Array, weight, policy: ExecutionPolicy | None = None) -> jax.Array:
    """x @ weight.T, weight [out, in] (checkpoint layout). A block-FP8 matrix runs `pallas_kernels.fp8.fp8_linear`
    with the policy's kernel backend on one device, and as the reference under a mesh (a Pallas call does not split
    over one), in the policy's `fp8_matmul` mode: AUTO by the row count (on a GPU: weight-only FP8 kernels for a few
    tokens, W8A8 for prefill-sized calls; dequantise-then-dot elsewhere), WEIGHT_ONLY or W8A8 always (W8A8's
    reference quantises the activations too). The reference, like any other weight, is the weight cast (or
    dequantised) to x's dtype, then the product. policy None: `ExecutionPolicy()`."""
    if _fp8_matrix(weight):
        return fp8_linear(x, weight, **_fp8_call(policy))
    return jnp.einsum("...i,oi->...o", x, dequantized(weight, x.dtype))


def _fp8_matrix(weight) -> bool:
    return isinstance(weight, BlockFP8Weight) and weight.values.ndim == 2


def _fp8_call(policy: ExecutionPolicy | None) -> dict:
    """The backend and mode arguments of the FP8 linear ops under `policy` (`project`)."""
    policy = as_policy(policy)
    mode = None if policy.fp8_matmul == FP8Matmul.AUTO else policy.fp8_matmul.value
    return {"backend": op_backend(policy, reference_on_mesh=True), "mode": mode}


def linear(weights: Weights, x: jax.Array, policy: ExecutionPolicy | None = None) -> jax.Array:
    """x @ weight.T (`project`)."""
    return project(x, weights["weight"], policy)


def linear_many(weights: Sequence[Weights], x: jax.Array, policy: ExecutionPolicy | None = None) -> list[jax.Array]:
    """[linear(w, x, policy) for w in weights]: the projections of one x (a layer's inputs). The block-FP8 matrices
    among them go together to `pallas_kernels.fp8.fp8_linear_many`, one kernel for all on a GPU at decode sizes
    (`project`'s backend and mode: under a mesh each runs the reference, as in `linear`); every other weight, and
    every other size, is `linear`'s product."""
    matrices = [w["weight"] for w in weights]
    grouped = [i for i, m in enumerate(matrices) if _fp8_matrix(m)]
    ys = dict(zip(grouped, fp8_linear_many(x, [matrices[i] for i in grouped], **_fp8_call(policy)), strict=True))
    return [ys[i] if i in ys else project(x, m, policy) for i, m in enumerate(matrices)]


def rms_norm(weights: Weights, x: jax.Array, eps: float, policy: ExecutionPolicy | None = None) -> jax.Array:
    """weight * (x / rms(x)): normalised in fp32, cast back to x's dtype, then scaled (spec §5). policy: run
    `pallas_kernels.norm.rms_norm` with its kernel backend on one device, the reference under a mesh (the decoder
    layers' norms); None: the jnp reference."""
    norm = functools.partial(rms_norm_op, eps=eps, backend=_norm_backend(policy))
    return per_shard(norm, in_axes=(_rows(x), None), out_axes=(_rows(x),))(x, weights["weight"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SplitSum:
    """A layer's output left as partial sums [S, N, D] (N: its tokens; fp32, or the activations' dtype for one
    split) that add up to it in split order: a kernel's splits of a product's K range, for the norm after the layer
    to add (`add_rms_norm`) rather than a launch of their own. One device only."""

    partials_SND: jax.Array

    def total(self, like: jax.Array) -> jax.Array:
        """The sum, in like's dtype and shape."""
        return jnp.sum(self.partials_SND, axis=0).astype(like.dtype).reshape(like.shape)


def add_rms_norm(
    weights: Weights, x: jax.Array, residual: jax.Array | SplitSum, eps: float, policy: ExecutionPolicy | None = None
) -> tuple[jax.Array, jax.Array]:
    """(x + residual, rms_norm of it), one kernel on a GPU; policy as for `rms_norm`. residual a `SplitSum`: its
    partial sums added first, split after split (`add_partials_rms_norm`)."""
    if isinstance(residual, SplitSum):
        weight = weights["weight"]
        return add_partials_rms_norm_op(x, residual.partials_SND, weight, eps, backend=_norm_backend(policy))
    norm = functools.partial(add_rms_norm_op, eps=eps, backend=_norm_backend(policy))
    return per_shard(norm, in_axes=(_rows(x), _rows(x), None), out_axes=(_rows(x),) * 2)(x, residual, weights["weight"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GatedNormInput:
    """An output projection's input before KDA's gated output norm: o [B, T, C] and the norm (its gate [B, T, C],
    weight and eps), for `linear_add_rms_norm` to apply where it is cheapest (`normalized`: the norm alone)."""

    o_BTC: jax.Array
    norm: GatedHeadNorm

    def normalized(self) -> jax.Array:
        return gated_head_norm(self.o_BTC, self.norm)


def linear_add_rms_norm(
    weights: Weights,
    o_BTC: jax.Array | GatedNormInput,
    residual_BTD: jax.Array,
    norm_weights: Weights,
    eps: float,
    policy: ExecutionPolicy | None = None,
    *,
    product_scope: str = "output_projection",
) -> tuple[jax.Array, jax.Array]:
    """add_rms_norm(norm_weights, residual, y, eps, policy) of the projection y = linear(weights, o, policy) (an
    output projection, y [B, T, D] constrained as the layer's activations): a decoder layer's attention output, its
    residual add and the norm after it. Where y's product is the decode gemv (`fp8_linear_partials`: a block-FP8
    weight on one GPU, a few rows) and o has the residual's dtype, the gemv's split-K partial sums go unreduced to
    the norm's kernel, which adds them (`pallas_kernels.norm.add_partials_rms_norm`: y as the gemv's reduction
    gives it, within fp32 rounding of the order of the sum); policy None: the unfused path, as `add_rms_norm`.
    product_scope: the product's named scope (a decoder layer's mixer, where a profile counts it); the norm's is
    the caller's. o a `GatedNormInput`: its norm runs in the gemv as it reads o where the partial sums come from it
    (`fp8_linear_partials`' norm), else before the projection, as `GatedNormInput.normalized`."""
    weight = weights["weight"]
    pending = o_BTC if isinstance(o_BTC, GatedNormInput) else None
    o_BTC = o_BTC if pending is None else pending.o_BTC
    with jax.named_scope(product_scope):
        fusable = policy is not None and _fp8_matrix(weight) and o_BTC.dtype == residual_BTD.dtype
        norm = None if pending is None else pending.norm
        partials_SND = fp8_linear_partials(o_BTC, weight, norm=norm, **_fp8_call(policy)) if fusable else None
        if partials_SND is None:
            o_BTC = o_BTC if pending is None else pending.normalized()
            y_BTD = constrain(linear(weights, o_BTC, policy), *ACTIVATION_BTD)
    if partials_SND is None:
        return add_rms_norm(norm_weights, residual_BTD, y_BTD, eps, policy)
    return add_partials_rms_norm_op(
        residual_BTD, partials_SND, norm_weights["weight"], eps, backend=_norm_backend(policy)
    )


def _norm_backend(policy: ExecutionPolicy | None) -> str:
    return KernelBackend.REFERENCE.value if policy is None else op_backend(policy, reference_on_mesh=True)


def _rows(x: jax.Array) -> tuple[str | None, ...]:
    """A norm's input: each row its own, the leading dimension split like a batch (`per_shard`)."""
    return ("activation_batch",) + (None,) * (x.ndim - 1)


def gated_rms_norm(weights: Weights, x: jax.Array, gate: jax.Array, eps: float) -> jax.Array:
    """KDA output norm: (x / rms(x)) * weight * sigmoid(gate), entirely in fp32, then cast (spec §2 step 8)."""
    normed = rms_normalize(x.astype(jnp.float32), eps) * weights["weight"].astype(jnp.float32)
    return (normed * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)


def param(value: jax.Array, axes: tuple[str | None, ...], *, quantizable: bool = False) -> nnx.Param:
    """A parameter annotated with one logical axis name per dimension (sharding is applied later, explicitly).
    quantizable: its layer accepts a quantised weight in its place (loaders keep a quantised checkpoint tensor
    quantised only there)."""
    if len(axes) != value.ndim:
        raise ValueError(f"{len(axes)} logical axes {axes} for a parameter of shape {value.shape}")
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False, quantizable=quantizable)


def normal_param(
    rngs: nnx.Rngs,
    shape: tuple[int, ...],
    dtype,
    axes: tuple[str | None, ...],
    std: float = DEFAULT_INIT_STD,
    *,
    quantizable: bool = False,
) -> nnx.Param:
    value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return param(value, axes, quantizable=quantizable)


class Linear(nnx.Module):
    """y = x @ weight.T with weight [out_features, in_features], no bias (no Ling projection has one); the weight
    may be quantised (`linear`)."""

    def __init__(
        self, in_features: int, out_features: int, *, axes: tuple[str | None, str | None], dtype, rngs: nnx.Rngs
    ):
        """axes: logical names of (out_features, in_features)."""
        self.weight = normal_param(rngs, (out_features, in_features), dtype, axes, quantizable=True)

    def __call__(self, x: jax.Array, policy: ExecutionPolicy | None = None) -> jax.Array:
        return linear(params_of(self), x, policy)


class RMSNorm(nnx.Module):
    """weight * (x / rms(x)): normalised in fp32, cast back to the input dtype, then scaled (spec §5); the jnp
    reference (`rms_norm`)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = param(jnp.ones((dim,), dtype), ("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(params_of(self), x, self.eps)


class GatedRMSNorm(nnx.Module):
    """KDA output norm: (x / rms(x)) * weight * sigmoid(gate), entirely in fp32, then cast (spec §2 step 8)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = param(jnp.ones((dim,), dtype), ("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        return gated_rms_norm(params_of(self), x, gate, self.eps)
