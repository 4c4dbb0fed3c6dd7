"""Launch settings of the MLA kernels, keyed by (device kind, shape bucket, dtype) (`pallas_kernels.tuning`).

The GPU entries were measured on an H200 at Ling widths (H = 64, R = 512, P = 64; bf16 caches); other GPUs take
the same values (the ANY entries). The TPU entry was chosen, not measured: there are no TPU rows in BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.tuning import ANY, H200, Entry


@dataclasses.dataclass(frozen=True)
class DecodeTritonTiles:
    """gpu_triton decode: block_k cache slots a step, head_block heads a program (>= 16, heads padded to it)."""

    block_k: int
    head_block: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class DecodeMosaicTiles:
    """gpu_mosaic decode: block_k slots a tile, `stages` ring buffers, P·V in pv_chunk-column products,
    approx_math: the softmax's exp as ex2.approx."""

    block_k: int
    stages: int
    pv_chunk: int
    approx_math: bool


@dataclasses.dataclass(frozen=True)
class DecodeTpuTiles:
    block_k: int  # cache slots a tile, a multiple of 16 (paged: slots a block, rounded down to whole pages)
    num_splits: int  # sequence splits (parallel: both cores of a megacore chip on one sequence)


@dataclasses.dataclass(frozen=True)
class PrefillTiles:
    """gpu_triton prefill: keys expanded `segment` slots at a time, flash attention in block_q x block_k tiles."""

    segment: int
    block_q: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class PrefillMosaicTiles:
    """gpu_mosaic prefill: keys expanded `segment` slots at a time, block_k keys a tile through `stages` ring
    buffers; approx_math: the softmax's exp as ex2.approx; ping_pong: the consumers' softmax and products
    alternate; p_in_registers: P to wgmma from registers; overlap_softmax: a tile's softmax runs while the tensor
    cores form the next tile's scores (`gpu_mosaic_prefill._consumer`)."""

    segment: int
    block_k: int
    stages: int
    approx_math: bool
    ping_pong: bool = False
    p_in_registers: bool = False
    overlap_softmax: bool = False


@dataclasses.dataclass(frozen=True)
class AbsorbTiles:
    """gpu_triton absorbed products: output columns a program (a power of two dividing the widths)."""

    block: int
    num_warps: int


def _gpu(entries: dict) -> dict:
    """The H200's entries {(bucket, dtype): Entry}, also the defaults for every other device."""
    return {(device, *key): entry for key, entry in entries.items() for device in (H200, ANY)}


_TRITON_DECODE = (
    "docs/benchmarks/mla.md#triton-kernel-before-the-mosaic-gpu-kernel: "
    "variant (bk, hb, warps, stages) = (64, 64, 8, 2) best at B=64 L=32768 and B=8 L=131072"
)
DECODE_TRITON = _gpu(
    {
        (ANY, "16bit"): Entry(DecodeTritonTiles(block_k=64, head_block=64, num_warps=8, num_stages=2), _TRITON_DECODE),
        (ANY, ANY): Entry(
            DecodeTritonTiles(block_k=32, head_block=16, num_warps=4, num_stages=2),
            "not measured: fp32 tiles at half the bf16 size, to fit 227 KiB of shared memory with two "
            f"pipeline stages ({_TRITON_DECODE})",
        ),
    }
)
DECODE_MOSAIC = _gpu(
    {
        (ANY, ANY): Entry(
            DecodeMosaicTiles(block_k=64, stages=2, pv_chunk=128, approx_math=True),
            "docs/benchmarks/mla.md#mosaic-gpu-kernel-2026-11-29-evening: the B=64 "
            "/ 8 / 1 rows, against "
            "'accurate exp 0.703 / 0.357 / 0.173' and the earlier 64-column and one-product P·V runs",
        )
    }
)
# `mla_decode` runs gpu_mosaic from this many cache slots in the batch (B x L), gpu_triton below: the ~0.1 ms
# idle gap per call that only larger caches repay (docs/benchmarks/mla.md#mosaic-gpu-kernel-2026-11-29-evening).
MOSAIC_MIN_SLOTS = 1 << 18
DECODE_TPU = {
    (ANY, ANY, ANY): Entry(
        DecodeTpuTiles(block_k=256, num_splits=2),
        "not measured: 256-slot tiles (288 KiB of bf16 cache), a split per core",
    )
}
# tpu_mosaic paged decode: block_k // page_size whole pages a block (at least one), each page its own DMA.
DECODE_PAGED_TPU = {
    (ANY, ANY, ANY): Entry(
        DecodeTpuTiles(block_k=512, num_splits=2),
        "not measured (no TPU): 8 of ling-serve's 64-slot pages a block, a split per core; libtpu's schedule "
        "(docs/kernels.md#paged-mla-decode-on-tpu) gives a grid step of 4 pages 751 / 936 bundles (32 / 64 heads), "
        "of 8 pages 1,284 / 1,529: fewer per slot, near the contiguous kernel's 631 / 804 for 256 slots",
    )
}
PREFILL = _gpu(
    {
        (ANY, ANY): Entry(
            PrefillTiles(segment=4096, block_q=64, block_k=64, num_warps=4, num_stages=2),
            "docs/benchmarks/mla.md#mla-prefill-attention-benchmarksmla_prefillpy: columns 'Pallas, segment 4096' "
            "(2.550 / 9.997 ms) "
            "against 'segment 2048'; the flash tiles not swept",
        )
    }
)
PREFILL_MOSAIC = _gpu(
    {
        (ANY, ANY): Entry(
            PrefillMosaicTiles(
                segment=8192, block_k=64, stages=2, approx_math=True, ping_pong=True, p_in_registers=False
            ),
            "docs/benchmarks/mla.md#the-mosaic-gpu-prefill-kernel-against-the-triton-one-on-an-h100-2026-12-07-"
            "thirty-third-session: segment 8192 with ping-pong 12.983 ms against 14.421 without and 14.788 / "
            "14.422 at segment 4096 (H=32); 64-key tiles in two stages, the most that fits 227 KiB of shared "
            "memory beside the consumers' queries and running outputs",
        )
    }
)
_SMALL_KERNELS = "not swept; docs/benchmarks/generation.md#decode-step-fewer-fused-small-kernels-2026-11-29-evening"
ABSORB_QUERY = _gpu(
    {(ANY, ANY): Entry(AbsorbTiles(block=128, num_warps=4), f"{_SMALL_KERNELS}: mla_absorb_query 4.3 us per layer")}
)
EXPAND_OUTPUT = _gpu(
    {(ANY, ANY): Entry(AbsorbTiles(block=32, num_warps=4), f"{_SMALL_KERNELS}: mla_expand_output 4.6 us per layer")}
)
