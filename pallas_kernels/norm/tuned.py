"""Launch settings of the RMSNorm kernels, keyed by (device kind, shape bucket, dtype) (`pallas_kernels.tuning`)."""

from __future__ import annotations

import dataclasses

from pallas_kernels.tuning import ANY, Entry


@dataclasses.dataclass(frozen=True)
class RowTiles:
    """gpu_triton: Triton warps of the one-row program (the whole row of D values in registers)."""

    num_warps: int


ROWS = {
    (ANY, ANY, ANY): Entry(
        RowTiles(num_warps=4),
        "not swept; docs/benchmarks/generation.md#decode-step-fewer-fused-small-kernels-2026-11-29-evening: "
        "add_rms_norm 2.1 us and rms_norm 1.8 us per layer at D = 4096 with it",
    )
}
