"""Block-FP8 linear maps (spec §6.2): weight-only and W8A8 products with a block-FP8 weight."""

from pallas_kernels.fp8.ops import fp8_linear, fp8_linear_many, fp8_linear_partials
from pallas_kernels.fp8.reference import (
    GatedHeadNorm,
    dequantize_blocks,
    quantize_activations,
    w8a8_linear_reference,
    weight_only_linear_reference,
)

__all__ = [
    "GatedHeadNorm",
    "dequantize_blocks",
    "fp8_linear",
    "fp8_linear_many",
    "fp8_linear_partials",
    "quantize_activations",
    "w8a8_linear_reference",
    "weight_only_linear_reference",
]
