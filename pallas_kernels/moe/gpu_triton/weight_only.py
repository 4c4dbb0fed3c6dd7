"""Weight-only quantised MoE kernels on GPU (Pallas, Triton lowering): the fused gather + gate/up + SwiGLU and
down + weighted scatter kernels (`fused`) and the decode row kernels (`decode`), run with block-FP8 or MXFP4
experts read as stored (`weight_tiles`): each weight tile is loaded in its stored bytes (e4m3: half of bf16's,
packed E2M1: a quarter), dequantised on chip with its scales, and multiplied in the activation dtype (bf16
tensor cores, IEEE fp32 for fp32) into fp32 accumulators. The same kernel bodies as the dense variants; only
the weight-tile loader differs. No dense copy of an expert weight is ever written. The entry points are the
dense ones (which read any format as stored) that refuse dense weights.

Opt-in (`ops.WEIGHT_ONLY` named; the default dequantises, then runs the dense kernels). On an H200 (jax 0.11.2)
at Ling-3.1-flash size (512 experts, hidden 4096, width 1280, 128 x 128 FP8 blocks, 8192 tokens) the FP8 fused
kernels gave a rel. difference of 5.6 against the bf16 kernels on the same weights, while they pass at small
sizes. Cause (read from the lowering): Pallas's Triton lowering indexes a ref with 32-bit offsets unless the ref
holds more than 2^32 bytes, but the offsets are in elements and signed: an e4m3 stack of 512 x 1280 x 4096 =
2.7e9 one-byte elements overflows int32 past expert 409. The row kernels index the same stacks the same way.
The FP8 values then went to the kernels as uint16 pairs (`weight_tiles.BlockFP8`; verified at flash size on an
H200, and the default since 2026-12-02); now the lowering is patched to index such stacks with int64 offsets
(`compat.widen_triton_offsets`) and they go as stored; the pairs remain for a jax the patch does not fit.

Tiles: the dense variants' tuned tables (the same elements a tile; not measured with quantised weights yet:
benchmarks/moe/quantized.py sweeps them). At the grouped kernels' block_k of 64 / 128 a tile of a 128 x 128
block-FP8 weight takes one scale.
"""

from __future__ import annotations

import functools

from pallas_kernels.moe.gpu_triton.decode import routed_experts_gpu
from pallas_kernels.moe.gpu_triton.fused import down_scatter_gpu, gather_swiglu_gpu
from pallas_kernels.moe.gpu_triton.weight_tiles import is_quantized


def _quantized_only(entry, first: int, names: tuple[str, ...]):
    """`entry` refusing dense weights: its positional arguments first, first + 1, ... are the weights `names`."""

    @functools.wraps(entry)
    def checked(*args, **kwargs):
        for name, weight in zip(names, args[first : first + len(names)]):
            if not is_quantized(weight):
                raise ValueError(
                    f"{name}: the weight-only kernels take a quantised weight (values and scales: block FP8 or "
                    f"MXFP4), got a dense {weight.dtype} {tuple(weight.shape)}; dense weights run the 'gpu_triton' "
                    "variant"
                )
        return entry(*args, **kwargs)

    checked.__doc__ = f"`{entry.__name__}` with the expert weights {', '.join(names)} quantised (block FP8 or MXFP4)."
    return checked


gather_swiglu_weight_only_gpu = _quantized_only(gather_swiglu_gpu, 3, ("gate", "up"))
down_scatter_weight_only_gpu = _quantized_only(down_scatter_gpu, 4, ("down",))
routed_experts_weight_only_gpu = _quantized_only(routed_experts_gpu, 3, ("gate", "up", "down"))
