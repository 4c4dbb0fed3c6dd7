"""A tensor-core product added into a given accumulator in one Triton dot: `dot_into(acc, lhs, rhs)`.

`plgpu.dot` lowers to a Triton dot started from zeros, so `acc + dot(a, b)` is a dot and then an add on the CUDA
cores: on Hopper its wgmma group is waited for before the add, and two products summed (`dot(a, b) + dot(c, d)`)
are two groups, each waited for. `dot_into` lowers to the dot with `acc` as its accumulator, so a chain of them
is one wgmma chain in the tensor cores and one wait (the same registers accumulate).

The Triton lowering rule goes into Pallas's lowering registry (`jax._src.pallas.triton.lowering`, private; the same
in jax 0.10.2 and 0.11.2), registered on the first call, so that importing the package never depends on it;
elsewhere (Pallas interpret mode, any jit) the product is acc + an fp32 dot of the operands at the precision the
Triton dot takes (16-bit operands as they are, fp32 ones in tf32 or IEEE fp32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

dot_into_p = Primitive("triton_dot_into")


def dot_into(acc_MN: jax.Array, lhs_MK: jax.Array, rhs: jax.Array, *, trans_rhs: bool = False, allow_tf32: bool = True):
    """acc [M, N] fp32 + lhs [M, K] @ rhs ([K, N], or [N, K] with trans_rhs), lhs and rhs of one dtype: fp32
    operands in tf32 where allow_tf32, else IEEE fp32 (as `plgpu.dot`'s allow_tf32)."""
    if acc_MN.dtype != jnp.float32 or lhs_MK.dtype != rhs.dtype:
        raise ValueError(
            f"dot_into: an fp32 accumulator and operands of one dtype, got {acc_MN.dtype}, {lhs_MK.dtype}, {rhs.dtype}"
        )
    _register_triton_lowering()
    return dot_into_p.bind(acc_MN, lhs_MK, rhs, trans_rhs=trans_rhs, allow_tf32=allow_tf32)


def _product(acc_MN, lhs_MK, rhs, *, trans_rhs, allow_tf32):
    rhs_KN = rhs.T if trans_rhs else rhs
    if lhs_MK.dtype == jnp.float32:
        precision = jax.lax.DotAlgorithmPreset.TF32_TF32_F32 if allow_tf32 else jax.lax.Precision.HIGHEST
    else:
        precision = None
    return acc_MN + jnp.dot(lhs_MK, rhs_KN, precision=precision, preferred_element_type=jnp.float32)


def _abstract(acc_MN, lhs_MK, rhs, *, trans_rhs, allow_tf32):
    del lhs_MK, rhs, trans_rhs, allow_tf32
    return jax.core.ShapedArray(acc_MN.shape, jnp.float32)


@functools.cache
def _register_triton_lowering() -> None:
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt_dialect
    from jax._src.pallas.triton import lowering as triton_lowering

    def rule(ctx, acc_MN, lhs_MK, rhs, *, trans_rhs, allow_tf32):
        rhs_KN = tt_dialect.trans(rhs, (1, 0)) if trans_rhs else rhs
        precision = None
        if ir.RankedTensorType(lhs_MK.type).element_type == ir.F32Type.get():
            precision = tt_dialect.InputPrecision.TF32 if allow_tf32 else tt_dialect.InputPrecision.IEEE
        return tt_dialect.dot(lhs_MK, rhs_KN, acc_MN, input_precision=precision)

    triton_lowering.register_lowering(dot_into_p)(rule)


dot_into_p.def_impl(_product)
dot_into_p.def_abstract_eval(_abstract)
mlir.register_lowering(dot_into_p, mlir.lower_fun(_product, multiple_results=False))
