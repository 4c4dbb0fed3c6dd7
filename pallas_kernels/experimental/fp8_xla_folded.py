"""Lab variants: weight-only block-FP8 linear for decode-sized calls written for XLA, not Pallas: the weight scales
are folded into x, so that the only thing done to the e4m3 weight is a convert, which XLA fuses into its read.
Importing this module registers `weight_only_linear_xla` and `weight_only_linear_xla_reduce` as "xla_folded" and
"xla_folded_reduce" of `pallas_kernels.fp8.ops.VARIANTS["weight_only_linear"]`, GPU variants (the decode kernels
they were measured against on the H200: slower than the weight-only kernels, docs/benchmarks/matmul.md,
'Decode rows again, the XLA scale-folded product, and the Mosaic W8A8 kernel measured (2026-12-03)'), named only.

W[o, i] = values[o, i] * scales[o // br, i // bc], so for the outputs o of row block b,
y[m, o] = sum_i (x[m, i] * scales[b, i // bc]) * values[o, i]: each row block is a product of its own scaled copy
of x, x_s [M, O / br, In], with its br rows of values. That is a batched product over the row blocks with the
values as stored ([O / br, br, In]: a free reshape, the batch axis major) and x_s small at decode sizes
(M x O / br x In: 0.5 MB for one row of an 8192 x 4096 weight). x_s is rounded to x's dtype (bf16: a relative
2^-9 per element, the rounding a bf16 activation has anyway); fp32 x stays exact. Products accumulate in fp32.

O and In must be multiples of the block (`takes`, the records'): the checkpoints' 128 x 128 projections are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import variants
from pallas_kernels.fp8 import ops
from pallas_kernels.variants import Variant


def _fits(values_NK, block: tuple[int, int]) -> bool:
    return values_NK.ndim == 2 and values_NK.shape[0] % block[0] == 0 and values_NK.shape[1] % block[1] == 0


def takes(x, weight) -> bool:
    """Whether the products run x @ W^T (the records' `takes`): 2-D values whose sides are multiples of the block."""
    return _fits(weight.values, tuple(weight.block))


@functools.partial(jax.jit, static_argnames=("block",))
def weight_only_linear_xla(x_MK, values_NK, scales, block: tuple[int, int]) -> jax.Array:
    """y [M, N] in x's dtype: x [M, K] @ W^T for the block-FP8 weight (values [N, K] e4m3, scales [N / br, K / bc]),
    the scales folded into x (module docstring)."""
    _check(values_NK, block)
    x_MBK, values_BRK = _folded(x_MK, values_NK, scales, block)
    y_MBR = jnp.einsum(
        "mbk,brk->mbr",
        x_MBK,
        values_BRK.astype(x_MK.dtype),
        preferred_element_type=jnp.float32,
        precision=jax.lax.Precision.HIGHEST,  # fp32 x: no TF32
    )
    return y_MBR.reshape(x_MK.shape[0], values_NK.shape[0]).astype(x_MK.dtype)


@functools.partial(jax.jit, static_argnames=("block",))
def weight_only_linear_xla_reduce(x_MK, values_NK, scales, block: tuple[int, int]) -> jax.Array:
    """`weight_only_linear_xla` as an elementwise product and a sum over K (a reduction XLA fuses with the
    convert), not a dot."""
    _check(values_NK, block)
    x_MBK, values_BRK = _folded(x_MK, values_NK, scales, block)
    products_MBRK = x_MBK.astype(jnp.float32)[:, :, None, :] * values_BRK.astype(jnp.float32)[None]
    return jnp.sum(products_MBRK, axis=-1).reshape(x_MK.shape[0], values_NK.shape[0]).astype(x_MK.dtype)


def _check(values_NK, block) -> None:
    if not _fits(values_NK, block):
        raise ValueError(
            f"weight_only_linear_xla: the weight's sides must be multiples of its block {tuple(block)}, got "
            f"{list(values_NK.shape)}"
        )


def _folded(x_MK, values_NK, scales, block):
    """(x_s [M, N / br, K] in x's dtype: x times each row block's scales, values [N / br, br, K] as stored)."""
    block_rows, block_cols = block
    n_dim, k_dim = values_NK.shape
    scales_BK = jnp.repeat(scales.astype(jnp.float32), block_cols, axis=1)
    x_MBK = (x_MK.astype(jnp.float32)[:, None, :] * scales_BK[None]).astype(x_MK.dtype)
    return x_MBK, values_NK.reshape(n_dim // block_rows, block_rows, k_dim)


def _variant(product) -> Variant:
    """`product` as a GPU variant: the kernels' entry-point keywords (XLA compiles it: nothing to interpret)."""

    def entry(x_MK, values_NK, scales, *, block: tuple[int, int], interpret: bool = False):
        del interpret
        return product(x_MK, values_NK, scales, block)

    return Variant("gpu", entry, takes=takes)


variants.register(ops.VARIANTS, "weight_only_linear", "xla_folded", _variant(weight_only_linear_xla))
variants.register(ops.VARIANTS, "weight_only_linear", "xla_folded_reduce", _variant(weight_only_linear_xla_reduce))
