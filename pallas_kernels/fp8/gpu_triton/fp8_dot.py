"""The FP8 x FP8 tile product of the W8A8 kernels, with the tensor cores' own accumulation over the tile's K.

`plgpu.dot` of two e4m3 tiles lowers to a Triton dot with `maxNumImpreciseAcc` unset, which Triton reads as 0:
on Hopper every FP8 wgmma instruction (32 inputs) is then started from zero and its result added to the fp32
accumulator on the CUDA cores (Triton's "partial accumulator"), which serialises the wgmma chain. `fp8_dot`
lowers to the same dot with `maxNumImpreciseAcc` past any tile's K, so the tile's whole K (one scale block, 128
inputs) accumulates in the tensor cores; the block-scaled kernels then scale that partial product and add it to
their fp32 accumulator once per K block (the promotion interval DeepSeek-V3 uses for its FP8 GEMMs).

The Triton lowering rule goes into Pallas's lowering registry (`jax._src.pallas.triton.lowering`, private; the same
in jax 0.10.2 and 0.11.2), registered on the first call, so that importing the package never depends on it;
elsewhere (Pallas interpret mode, any jit) the product is an fp32 dot of the upcast tiles: e4m3 products are exact
in fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

# Above any tile's K: Triton never splits the wgmma chain of one dot (`needsPartialAccumulator` is false).
_NO_PARTIAL_ACCUMULATION = 2**30

fp8_dot_p = Primitive("fp8_dot_tc_accumulated")


def fp8_dot(lhs_MK: jax.Array, rhs_NK: jax.Array) -> jax.Array:
    """lhs [M, K] @ rhs [N, K]^T -> fp32 [M, N], both e4m3 (module docstring)."""
    if lhs_MK.dtype != jnp.float8_e4m3fn or rhs_NK.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"fp8_dot takes two float8_e4m3fn tiles, got {lhs_MK.dtype} and {rhs_NK.dtype}")
    _register_triton_lowering()
    return fp8_dot_p.bind(lhs_MK, rhs_NK)


def _product(lhs_MK, rhs_NK):
    return jnp.dot(lhs_MK.astype(jnp.float32), rhs_NK.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)


def _abstract(lhs_MK, rhs_NK):
    return jax.core.ShapedArray((lhs_MK.shape[0], rhs_NK.shape[0]), jnp.float32)


@functools.cache
def _register_triton_lowering() -> None:
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith as arith_dialect
    from jax._src.lib.triton import dialect as tt_dialect
    from jax._src.pallas.triton import lowering as triton_lowering

    def rule(ctx, lhs_MK, rhs_NK):
        del ctx
        num_rows, num_cols = ir.RankedTensorType(lhs_MK.type).shape[0], ir.RankedTensorType(rhs_NK.type).shape[0]
        f32 = ir.F32Type.get()
        zeros_MN = tt_dialect.splat(
            ir.RankedTensorType.get([num_rows, num_cols], f32), arith_dialect.constant(f32, 0.0)
        )
        rhs_KN = tt_dialect.trans(rhs_NK, (1, 0))
        return tt_dialect.dot(lhs_MK, rhs_KN, zeros_MN, max_num_imprecise_acc=_NO_PARTIAL_ACCUMULATION)

    triton_lowering.register_lowering(fp8_dot_p)(rule)


fp8_dot_p.def_impl(_product)
fp8_dot_p.def_abstract_eval(_abstract)
mlir.register_lowering(fp8_dot_p, mlir.lower_fun(_product, multiple_results=False))


def scaled_fp8_product(lhs_MK, rhs_NK, row_scale_M, rhs_scale) -> jax.Array:
    """fp32 [M, N]: the FP8 product of one K block times its scales, row_scale [M] (the activation's, per token)
    and rhs_scale (the weight block's: a scalar, or [N])."""
    rhs_scale_N = rhs_scale if jnp.ndim(rhs_scale) == 0 else rhs_scale[None, :]
    return fp8_dot(lhs_MK, rhs_NK) * (row_scale_M[:, None] * rhs_scale_N)
