"""Launch settings of the KDA kernels, keyed by (device kind, shape bucket, dtype) (`pallas_kernels.tuning`).

Every GPU entry was measured on an H200 at H = 64, K = V = 128 (B=1 T=32768 and B=8 T=4096 for the prefill,
B in {1, 64, 256} for decode); other GPUs take the same values (the ANY entries). The TPU entries were chosen to
fit VMEM, not measured: there are no TPU rows in BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.tuning import ANY, H200, Entry


@dataclasses.dataclass(frozen=True)
class IntraTiles:
    """gpu_triton prefill phase 1: keys through block_k columns at a time, Triton warps and stages of the keys and
    block-row kernels, warps of the WY-factors kernel."""

    block_k: int
    num_warps: int
    num_stages: int
    factors_num_warps: int


@dataclasses.dataclass(frozen=True)
class InterTiles:
    """gpu_triton prefill phase 2 (the sequential state pass): block_v state columns per program; state_rows: the
    state held transposed, so that each product's M side is block_v rows rather than a chunk's tokens."""

    block_v: int
    num_warps: int
    num_stages: int
    state_rows: bool = False


@dataclasses.dataclass(frozen=True)
class ShortChunkTiles:
    """gpu_triton_short prefill phase 1: chunks a program, Triton warps; chunk: tokens a chunk (16 or 32; phase 2
    then walks T / chunk steps); paired (16-token chunks, a state pass with state_rows): the parts as
    `intra.PairedParts`, so that the state pass makes one product with the state a step where it made two, and
    none with a_qk."""

    chunks: int
    num_warps: int
    chunk: int = 16
    paired: bool = False


@dataclasses.dataclass(frozen=True)
class ChunkTiles:
    """gpu_triton prefill, both phases: phase 1's tiles (`IntraTiles`, or a lab phase 1's own) and phase 2's; None
    takes that phase's table (`CHUNK_INTRA` / `CHUNK_INTRA_ANY_GATE` by the gates, `CHUNK_INTER`)."""

    intra: object | None = None
    inter: InterTiles | None = None


@dataclasses.dataclass(frozen=True)
class DecodeGpuTiles:
    block_v: int
    num_warps: int


@dataclasses.dataclass(frozen=True)
class DecodeFusedGpuTiles:
    """The fused decode step: value_splits programs a sequence-head (each owning V / value_splits columns of its
    state; None: `gpu_triton.decode_fused.value_splits`' rule by the SMs), walked block_v columns at a time."""

    block_v: int
    num_warps: int
    value_splits: int | None = None


@dataclasses.dataclass(frozen=True)
class DecodeTpuTiles:
    head_block: int


def h200_and_default(params, source: str) -> dict:
    """The H200's entry, also the default for every other device."""
    entry = Entry(params, source)
    return {(H200, ANY, ANY): entry, (ANY, ANY, ANY): entry}


CHUNK_INTRA = h200_and_default(
    IntraTiles(block_k=128, num_warps=2, num_stages=1, factors_num_warps=2),
    "docs/benchmarks/kda.md#phase-1-as-two-kernels-grid-order-2026-11-30: 2 warps fastest "
    "for the block-row kernel (4 warps 6.0-6.6 ms), num_stages 2 or 3 no change, and the WY factors "
    "with 2 warps against 'The call before (... merge kernel 4 warps)'",
)
CHUNK_INTRA_ANY_GATE = h200_and_default(
    IntraTiles(block_k=128, num_warps=2, num_stages=1, factors_num_warps=2),
    "not measured: CHUNK_INTRA's settings (docs/benchmarks/kda.md#phase-1-as-two-kernels-grid-order-2026-11-30"
    "); the any-gate variant differs only in its diagonal 16x16 blocks (gpu_triton/blocks.py)",
)
_SHORT_SOURCE = "docs/benchmarks/kda.md#16-token-chunks-gpu_triton_short-measured-2026-12-06-twenty-third-session"
CHUNK_SHORT = h200_and_default(
    ShortChunkTiles(chunks=1, num_warps=2),
    f"{_SHORT_SOURCE} (H100): phase 1 3.03 ms at B=1 T=32768 H=64 with one chunk a program, 10.11 ms with 4; "
    "docs/benchmarks/kda.md#two-warps-a-program-for-phase-1-2026-12-06-twenty-fourth-session (H100): 2 warps 5.33 / "
    "5.65 ms the whole prefill against 6.47 / 6.45 at 4 warps, 8.57-9.72 at 8, same runs",
)
CHUNK_INTER = h200_and_default(
    InterTiles(block_v=64, num_warps=4, num_stages=2),
    "docs/benchmarks/kda.md#phase-1-as-three-kernels-2026-11-29-night, row 'phase 2 "
    "block_v 64' (phase 2 1.68 ms against 2.59 at block_v 32); "
    "docs/benchmarks/kda.md#the-keys-kernel-first-prefill-faster-than-fla-2026-11-30-second-session: block_v 128 / "
    "8 warps slower, the defaults (block_v 64, 4 warps) stay",
)
CHUNK_INTER_SHORT = h200_and_default(
    InterTiles(block_v=64, num_warps=4, num_stages=3, state_rows=True),
    f"{_SHORT_SOURCE} (H100): phase 2 after gpu_triton_short's phase 1, B=1 T=32768 H=64, 2.70 ms with the state "
    "transposed and 3 stages against 3.79 as CHUNK_INTER (B=8 T=4096: 1.54 against 2.28)",
)
DECODE_GPU = h200_and_default(
    DecodeGpuTiles(block_v=64, num_warps=4),
    "docs/benchmarks/kda.md#kda-decode-step-benchmarkskdapy---decode-only, B=64 row and 'Other B=64 tiles: "
    "(64, 4) 174.5, ...' (best of 5 tile variants at B >= 64; B=1 is faster with (16, 2) but launch-bound either way)",
)
DECODE_FUSED_GPU = h200_and_default(
    DecodeFusedGpuTiles(block_v=64, num_warps=4),
    "not measured: DECODE_GPU's tile (a [K, 64] state slice, 4 warps), the value columns split over programs by "
    "the SMs (benchmarks/kda.py --decode-fused and benchmarks.generate --kda-decode separate,fused time it)",
)
DECODE_TPU = {
    (ANY, ANY, ANY): Entry(
        DecodeTpuTiles(head_block=8), "not measured: 8 heads' [K, V] fp32 states (512 KiB at K = V = 128) in VMEM"
    )
}
