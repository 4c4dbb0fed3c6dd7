"""Launch settings of the block-FP8 linear kernels, keyed by (device kind, shape bucket, dtype)
(`pallas_kernels.tuning`), and the row count from which `fp8_linear` quantises activations (W8A8).

The K step of both kernels is the weight's scale block (128 inputs), so only the output tile and the launch are
tuned. WEIGHT_ONLY is for decode-sized calls (a few rows: a stream of the FP8 weight), W8A8 for prefill-sized
ones (FP8 tensor cores). Entries without a measurement say so.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.tuning import ANY, H200, Entry

# From this many rows (tokens) on, `fp8_linear` runs W8A8; below, weight-only.
W8A8_MIN_ROWS = 128


@dataclasses.dataclass(frozen=True)
class LinearTiles:
    """gpu_triton: block_m rows x block_n outputs a program (block_n at most the weight's row block: one weight
    scale per K step), group_m row tiles whose programs run together (L2 reuse of the weight tiles)."""

    block_m: int
    block_n: int
    group_m: int
    num_warps: int
    num_stages: int


def _gpu(entries: dict) -> dict:
    """The H200's entries {(bucket, dtype): Entry}, also the defaults for every other device."""
    return {(device, *key): entry for key, entry in entries.items() for device in (H200, ANY)}


_UNMEASURED = "not measured: a first choice (narrow output tiles so that a few rows still fill the GPU)"
_UNMEASURED_MMA = "not measured: the serving stacks' usual block-FP8 tile (64 x 128, K step 128)"
WEIGHT_ONLY = _gpu(
    {
        (ANY, "16bit"): Entry(LinearTiles(16, 32, 1, 4, 4), _UNMEASURED),
        (ANY, ANY): Entry(LinearTiles(16, 32, 1, 4, 3), _UNMEASURED),
    }
)
W8A8 = _gpu({(ANY, ANY): Entry(LinearTiles(64, 128, 8, 4, 3), _UNMEASURED_MMA)})
