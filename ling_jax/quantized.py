"""Quantised weights on the device (spec §6.2 block FP8, §6.3 MXFP4) and their weight-only reference path.

A parameter the checkpoint stores quantised can stay quantised in the model: its `nnx.Param` then holds a
`BlockFP8Weight` or an `MXFP4Weight` (a pytree of the stored values and their scales) instead of an array. Both
arrays share the parameter's logical axes (its `out_sharding`), so a mesh splits them alike; `scale_block` says
how many weight elements of each dimension one scale covers, which a shard must hold whole
(`ling_jax.sharding.param_specs` refuses a mesh that would cut one).

The layers take either an array or a quantised weight: `dequantized(weight, dtype)` is the weight as a dense
array of `dtype`, computed inside the jitted step from the stored form, one layer at a time (the whole model is
never dequantised up front). That jnp dequantise-then-matmul path is the reference a fused FP8 / MXFP4 kernel
is tested against; training keeps dense (bf16 / fp32) master weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.quant import E2M1_VALUES, MXFP4_GROUP
from pallas_kernels.fp8.reference import dequantize_blocks


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockFP8Weight:
    """A block-FP8 weight [..., O, In]: float8_e4m3fn values [..., O, In] and float32 scales
    [..., ceil(O / block[0]), ceil(In / block[1])] that multiply them (`weight_scale_inv`). Stacked experts carry
    one scale grid per expert. The converter's FP8 checkpoints also hold MXFP4 experts this way: E4M3 codes with
    one scale per 1 x 32 block."""

    values: jax.Array
    scales: jax.Array
    block: tuple[int, int] = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense weight's shape."""
        return tuple(self.values.shape)

    @property
    def scale_block(self) -> tuple[int, int]:
        """Weight elements (rows, cols) one scale covers."""
        return self.block

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes

    def dequantize(self, dtype) -> jax.Array:
        return dequantize_blocks(self.values, self.scales, self.block, dtype)

    def with_leaves(self, leaf) -> BlockFP8Weight:
        """The same structure with `leaf` for both arrays (a PartitionSpec, a sharding)."""
        return dataclasses.replace(self, values=leaf, scales=leaf)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXFP4Weight:
    """An MXFP4 weight [..., O, In] (routed experts): uint8 values [..., O, In / 2], element 2j in the low nibble
    of byte j (E2M1 codes), and one E8M0 scale per 32 inputs [..., O, ceil(In / 32)] (float8_e8m0fnu, or the
    float powers of two a checkpoint may store instead)."""

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense weight's shape."""
        return (*self.values.shape[:-1], 2 * self.values.shape[-1])

    @property
    def scale_block(self) -> tuple[int, int]:
        return (1, MXFP4_GROUP)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes

    def dequantize(self, dtype) -> jax.Array:
        codes = self.values
        nibbles = jnp.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(self.shape)
        elements = jnp.asarray(E2M1_VALUES)[nibbles]
        full_scales = jnp.repeat(self.scales.astype(jnp.float32), MXFP4_GROUP, axis=-1)[..., : self.shape[-1]]
        return (elements * full_scales).astype(dtype)

    def with_leaves(self, leaf) -> MXFP4Weight:
        return dataclasses.replace(self, values=leaf, scales=leaf)


QUANTIZED_TYPES = (BlockFP8Weight, MXFP4Weight)
QuantizedWeight = BlockFP8Weight | MXFP4Weight


def is_quantized(weight) -> bool:
    return isinstance(weight, QUANTIZED_TYPES)


def dequantized(weight, dtype) -> jax.Array:
    """`weight` as a dense array of `dtype`: a quantised weight dequantised (the weight-only reference path), an
    array cast."""
    return weight.dequantize(dtype) if is_quantized(weight) else weight.astype(dtype)


def check_activation_dtype(dtype, where: str) -> np.dtype:
    """`dtype` if it can be a model (activation and dense weight) dtype; an FP8 one is refused."""
    dtype = np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or jnp.finfo(dtype).bits < 16:
        raise ValueError(
            f"{where}: dtype={dtype.name} is not a model dtype (activations and dense weights: bfloat16, float16 or "
            "float32); FP8 weights stay FP8 on the device with weights='stored', and there are no FP8 activations"
        )
    return dtype
