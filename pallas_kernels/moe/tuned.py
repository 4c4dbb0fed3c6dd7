"""Launch settings of the MoE kernels, keyed by (device kind, shape bucket, dtype) (`pallas_kernels.tuning`), and
the row count up to which a GPU runs the routed experts row by row (`ops.expert_path`).

The *_QUANTIZED tables are the fused and row kernels' settings for quantised experts (block FP8, MXFP4), read as
stored. Buckets of the grouped kernels: "few_rows" (decode: the groups average at most FEW_ROWS_PER_GROUP rows, so each
call streams the picked experts' weights) and "many_rows" (`rows_bucket`); of the routed-experts row kernels:
"one_token" and "tokens" (`tokens_bucket`). The GPU entries were measured on an H200 at hidden 4096, 512 experts,
top-8, width 1024, bf16 (the Ling-3.1-flash preset before its published widths; the published expert width is 1280),
unless their notes say otherwise; other GPUs take the same values (the ANY entries). fp32 (IEEE products, no
tensor cores) is untuned: its entries are the 16-bit ones shrunk to fit, not measured.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.tuning import ANY, H200, Entry

# Up to this many token-expert rows (8 tokens at top-8) a GPU runs the routed experts row by row
# (`ops.routed_experts`: no sort, each row streams its expert), above it the fused grouped kernels.
ROW_PATH_MAX_ROWS = 64
# The row kernels read block-FP8 experts as stored (weight-only), but MXFP4 ones only after the picked experts are
# dequantised (then the bf16 row kernels): on the H200 at Ling-3.1-flash width (2026-12-02,
# `benchmarks/moe/quantized.py`), the weight-only row kernels took 66.8 / 390.5 us at 1 / 8 tokens against 96.5 /
# 605.5 us for the picked experts dequantised; for MXFP4 they took 181.8 / 1048.6 against 100.4 / 604.7.
ROWS_WEIGHT_ONLY_MXFP4 = False
FEW_ROWS_PER_GROUP = 4


def rows_bucket(num_rows: int, num_groups: int) -> str:
    return "few_rows" if num_rows <= FEW_ROWS_PER_GROUP * num_groups else "many_rows"


def tokens_bucket(num_tokens: int) -> str:
    """The routed-experts row kernels' bucket: "one_token" or "tokens" (more than one; the down kernel's grid has
    tokens x D / block_n programs, so one token takes narrower tiles to fill the SMs)."""
    return "one_token" if num_tokens == 1 else "tokens"


@dataclasses.dataclass(frozen=True)
class GroupedTiles:
    """gpu_triton grouped kernels: block_m rows (for the weight gradient: rows a step), block_n x block_k tiles."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class RowTiles:
    """gpu_triton routed-experts row kernels: block_n output columns a program, block_k a step; in_flight: the
    weights whose tiles a K step loads before using any (SwiGLU: gate and up of a row, 2, or one after the other, 1;
    down + combine: the token's top_k + shared experts', in groups of in_flight, one loop a group), 0 for all;
    splits: the down kernel's K steps split over that many programs a column tile, their fp32 partial sums added
    after it (the SwiGLU kernel takes 1 only: its nonlinearity needs the whole sum)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    in_flight: int = 0
    splits: int = 1


@dataclasses.dataclass(frozen=True)
class SelectTiles:
    """gpu_triton expert selection (one token a program): warps a program."""

    num_warps: int


def _gpu(entries: dict) -> dict:
    """The H200's entries {(bucket, dtype): Entry}, also the defaults for every other device."""
    return {(device, *key): entry for key, entry in entries.items() for device in (H200, ANY)}


_FP32 = "fp32 untuned (IEEE products, no tensor cores): smaller tiles, not measured"


def _fp32_entries(many_rows_block_n: int) -> dict:
    """The untuned fp32 entries of a grouped kernel (both row buckets), its many-rows column tile given."""
    return {
        ("many_rows", ANY): Entry(GroupedTiles(64, many_rows_block_n, 32, 4, 3), _FP32),
        ("few_rows", ANY): Entry(GroupedTiles(16, 32, 64, 4, 3), _FP32),
    }


GROUPED_MATMUL = _gpu(
    {
        ("many_rows", "16bit"): Entry(
            GroupedTiles(128, 256, 64, 8, 4),
            "docs/benchmarks/moe.md#moe-layer-benchmarksmoepy, row '8192 | three grouped GEMMs alone' (128x256x64 "
            "tiles: the best of a small sweep at 65536 rows, 512 groups, K 4096, N 1024)",
        ),
        ("few_rows", "16bit"): Entry(
            GroupedTiles(16, 64, 128, 4, 4),
            "docs/benchmarks/moe.md#grouped-matmul-tiles-at-decode-sizes-benchmarksgrouped_matmulpy: the narrow tiles "
            "(16 x 64 x 128) best or near it at 8 and 64 rows for both shapes",
        ),
        **_fp32_entries(64),
    }
)
WEIGHT_GRAD = _gpu(
    {
        (ANY, "16bit"): Entry(
            GroupedTiles(32, 128, 128, 4, 4),
            "the sweep of 'MoE layer' 's grouped GEMMs, the weight-gradient kernel (a group's last row "
            "step is partial, so small steps win)",
        ),
        (ANY, ANY): Entry(GroupedTiles(32, 64, 64, 4, 3), _FP32),
    }
)
_FUSED = "docs/benchmarks/moe.md#fused-grouped-path-2026-11-29: the best of benchmarks/moe's tile sweep"
GATHER_SWIGLU = _gpu(
    {  # two accumulators: half the grouped matmul's column tile
        ("many_rows", "16bit"): Entry(GroupedTiles(128, 128, 64, 8, 4), f"{_FUSED} at 8192 tokens"),
        ("few_rows", "16bit"): Entry(GroupedTiles(32, 64, 128, 4, 4), f"{_FUSED} at 64 tokens"),
        **_fp32_entries(32),
    }
)
DOWN_SCATTER = _gpu(
    {
        ("many_rows", "16bit"): Entry(GroupedTiles(128, 256, 64, 8, 4), f"{_FUSED} at 8192 tokens"),
        ("few_rows", "16bit"): Entry(GroupedTiles(32, 64, 128, 4, 4), f"{_FUSED} at 64 tokens"),
        **_fp32_entries(64),
    }
)
# Quantised experts (block FP8, MXFP4: tiles read as stored and dequantised on chip, `weight_tiles`) move half or a
# quarter of the bytes a tile: measured on the H200 at Ling-3.1-flash width (hidden 4096, width 1280, 512 experts,
# top-8; `python -m benchmarks.moe --format fp8 mxfp4`'s sweep, 2026-12-03, issue 25), the two fused kernels together:
# - 8192 tokens, FP8: (64, 128, 64, 4 warps, 4 stages) 9.068 ms against 10.033 for the bf16 tiles (MXFP4: 15.49
#   against 15.42, within noise: one entry for both);
# - 64 tokens: (16, 64, 256, 3 stages, weight tile as the MMA's first operand) FP8 1.523 ms against 2.122 for
#   the bf16 tiles (MXFP4 2.195 against 3.014).
_QUANTIZED = "docs/benchmarks/moe.md#quantised-experts-their-own-tiles-2026-12-03"
GATHER_SWIGLU_QUANTIZED = _gpu(
    {
        ("many_rows", "16bit"): Entry(GroupedTiles(64, 128, 64, 4, 4), f"{_QUANTIZED}: FP8 9.068 ms at 8192 tokens"),
        ("few_rows", "16bit"): Entry(GroupedTiles(16, 64, 256, 4, 3), f"{_QUANTIZED}: FP8 1.523 ms at 64 tokens"),
        **_fp32_entries(32),  # two accumulators: half the column tile
    }
)
DOWN_SCATTER_QUANTIZED = _gpu(
    {
        ("many_rows", "16bit"): Entry(GroupedTiles(64, 128, 64, 4, 4), f"{_QUANTIZED}: with GATHER_SWIGLU_QUANTIZED"),
        ("few_rows", "16bit"): Entry(GroupedTiles(16, 64, 256, 4, 3), f"{_QUANTIZED}: with GATHER_SWIGLU_QUANTIZED"),
        **_fp32_entries(64),
    }
)
# the buckets in which the quantised fused kernels put the weight tile first in the MMA (`grouped.Tile.weight_products`)
WEIGHT_LEFT_QUANTIZED = ("few_rows",)
# The W8A8 routed-expert kernels: K steps of the weights' 128-input block, and the gate/up kernel's column tile is
# one 128-column group of h (quantised in its epilogue), so only block_m (and down's block_n, at most the weight's
# 128-row block) and the launch are free. Same settings for every dtype of x (the products are FP8 either way).
# Measured on the H200 at Ling-3.1-flash width (8192 tokens, top-8 of 512 experts, hidden 4096, width 1280;
# `benchmarks.moe --fp8-matmul w8a8 --sweep`, 2026-12-02, FP8 values as stored): gate/up 2.837 ms (484 TFLOP/s) against
# 3.331 for the earlier (64, 8 warps, 4 stages); the best, 2.756 ms, wanted min_block_m 64. down 1.836 ms against
# 2.033 for (128 x 128, 8 warps). Re-swept 2026-12-03 (10 iterations): gate/up at min_block_m 64 (a group's last
# tile at least 64 rows) 2.699 ms against 2.925 at 32 (the default until then); down's default stayed the best,
# 1.766 ms. 2026-12-07 on the H200: down at 3 stages (three programs an SM) 1.582 ms against 1.890 at 4, and 547.8
# against 642.8 us a call in the full-size Ling-3.0-flash prefill: down takes 3 stages.
# the smallest row tile of an expert's last tile (a power of two)
GATHER_SWIGLU_W8A8_MIN_BLOCK_M = 64
DOWN_SCATTER_W8A8_MIN_BLOCK_M = 64
# The column tiles a program of the W8A8 down kernel walks in one loop (`grouped.Tile.walk_columns`): on an H100
# (2026-12-07, alone) 1: 1.994 ms, 2: 2.301, 4: 2.378, 8: 1.853 -- no setting clearly ahead, so 1
DOWN_SCATTER_W8A8_COLUMNS = 1
_DOWN_W8A8_SOURCE = (
    "docs/benchmarks/moe.md#the-w8a8-experts-on-an-h200-chained-calls-the-byte-floor-a-joined-gateup-product-down-at-"
    "3-stages-2026-12-07-twenty-eighth-session: on the H200 down at 3 stages 1.582 ms against 4 stages 1.890 alone, "
    "547.8 against 642.8 us a call in the full-size Ling-3.0-flash prefill"
)
_W8A8_SOURCE = (
    "docs/benchmarks/moe.md#the-w8a8-experts-as-persistent-warp-specialised-mosaic-gpu-kernels-and-the-triton-w8a8-"
    "tiles-on-the-h100-2026-12-06-twenty-fifth-session: on an H100 gate/up 4 stages 2.831 ms against 3 stages 3.183, "
    "down min_block_m 64 1.877 against 32 2.129; equal on the H200 (2026-12-03: 2.711 / 2.699, 1.783 / 1.766)"
)
GATHER_SWIGLU_W8A8 = _gpu({(ANY, ANY): Entry(GroupedTiles(128, 128, 128, 8, 4), _W8A8_SOURCE)})
DOWN_SCATTER_W8A8 = _gpu({(ANY, ANY): Entry(GroupedTiles(64, 128, 128, 4, 3), _DOWN_W8A8_SOURCE)})


@dataclasses.dataclass(frozen=True)
class MosaicExpertTiles:
    """gpu_mosaic W8A8 experts: the gate/up kernel's pipeline stages (its column tile is one 128-column group of
    h), the down kernel's column tile (256: two 128-column products a TMA tile), stages and column tiles a work
    item (its largest divisor of D's column tiles that divides them); whether each kernel writes its output (h_q,
    y) through shared memory by TMA; the down kernel's K blocks a pipeline step (`fp8.gpu_mosaic_grouped`)."""

    gate_up_stages: int
    down_block_n: int
    down_stages: int
    down_columns: int
    gate_up_tma_store: bool = False
    down_tma_store: bool = False
    down_step_blocks: int = 1


W8A8_MOSAIC_EXPERTS = _gpu(
    {
        (ANY, ANY): Entry(
            MosaicExpertTiles(4, 128, 5, 4),
            "docs/benchmarks/moe.md#the-w8a8-experts-as-persistent-warp-specialised-mosaic-gpu-kernels-and-the-triton-"
            "w8a8-tiles-on-the-h100-2026-12-06-twenty-fifth-session: H100 5.655 ms (gate/up 3 stages 5.727; down 8 / 1 "
            "column tiles an item 5.747 / 5.848; down 2 stages 6.277; down tiles of 64 at 6 stages 6.143)",
        )
    }
)
_ROUTED = (
    "docs/benchmarks/generation.md#routed-experts-and-expert-selection-at-decode-sizes-chained-call-timing-2026-11-29, "
    "tile sweep at one token"
)
# Weights in flight (`RowTiles.in_flight`, 2026-12-05): each K step loads the tiles of several weights before using
# any (SwiGLU's gate and up; the down kernel's top_k + shared experts), one memory round trip a step for them all,
# or one weight's loop after the other (1). Tiles are bounded by the registers the tiles in flight take (Triton
# 3.6, sm_90: down (8, 256, 4, 3) all in flight 168 a thread, 147 with the slots' experts as scalar loads, (32, 256,
# 8, 3) 198).
_IN_FLIGHT = "docs/benchmarks/moe.md#decode-row-kernels-weights-in-flight-2026-12-05 (H100)"
_IN_MODEL = (
    "docs/benchmarks/generation.md#decode-launch-settings-timed-in-the-model-again-2026-12-06-nineteenth-session"
)
ROUTED_SWIGLU = _gpu(
    {
        (ANY, ANY): Entry(
            RowTiles(8, 256, 4, 4, in_flight=0),
            f"{_ROUTED}: SwiGLU rows (8, 256, 4, 4) 74.5 us; {_IN_FLIGHT}: both bf16 kernels with all in flight "
            "109.3 / 583.8 us at 1 / 8 tokens (width 1280) against 119.3 / 616.1 one weight after the other",
        )
    }
)
ROUTED_DOWN = _gpu(
    {
        (ANY, ANY): Entry(
            RowTiles(8, 256, 4, 3, in_flight=0),
            f"{_IN_FLIGHT}: with ROUTED_SWIGLU's, all in flight; the per-expert loop before it kept {_ROUTED}'s "
            "(8, 1024, 4, 3)",
        )
    }
)
# The row kernels on quantised experts, by `tokens_bucket`:
# docs/benchmarks/moe.md#fp8-row-kernel-tiles-at-1-and-8-tokens-w8a8-re-timed-2026-12-03-eighth-session
# (Ling-3.1-flash width 1280, one call of both kernels with the shared expert, the other kernel at (8, 512, 4, 3),
# the earlier default of both). MXFP4 experts take the same entries, not measured with them. All weights in flight
# won at one token in the model (Ling-3.0-flash's first 24 layers on an H100: decode step 2.52 -> 2.42 ms) and lost
# at 8 tokens (5.89 -> 6.22 ms; the FP8 rows alone at width 1280: 308.8 -> 376.7 us), so above one token the
# weights go one after the other as before.
_FLASH_ROWS = "FP8 experts at width 1280, both kernels and the shared expert, H200 2026-12-03"
ROUTED_SWIGLU_QUANTIZED = _gpu(
    {
        ("one_token", ANY): Entry(
            RowTiles(16, 512, 4, 3, in_flight=0),
            f"{_FLASH_ROWS}: 71.4 us at 1 token against 78.9 for (8, 512, 4, 3); {_IN_FLIGHT}: gate and up in flight",
        ),
        (ANY, ANY): Entry(
            RowTiles(16, 512, 4, 3, in_flight=1),
            f"{_FLASH_ROWS}: 375.2 us at 8 tokens against 384.8 for (8, 512, 4, 3); {_IN_FLIGHT}: one weight after "
            "the other",
        ),
    }
)
# The width split over 3 programs a column tile (`RowTiles.splits`; their partial sums added by XLA then, by the next
# norm now): full-size Ling-3.0-flash decode steps on an H200, 2026-12-06.
_SPLITS = "docs/benchmarks/generation.md#ling-30-flash-at-full-size-on-an-h200-2026-12-06-twentieth-session"
ROUTED_DOWN_QUANTIZED = _gpu(
    {
        ("one_token", ANY): Entry(
            RowTiles(8, 128, 4, 3, in_flight=0, splits=3),
            f"{_SPLITS}: 3.34 -> 3.23 ms at batch 1 (2 splits 3.36); "
            f"{_IN_MODEL}: K steps of 128 (256 before) in Ling-3.0-flash's first 24 layers on an H100, decode step "
            "at batch 1 2.33 -> 2.26 ms and 2.35 -> 2.29 in a second run (steps of 64: 3.02; of 128 with 16 columns "
            f"2.31); {_IN_FLIGHT}: every expert in flight (the per-expert loop before it: {_FLASH_ROWS}: "
            "(8, 512, 4, 3) 78.9 us at 1 token, (32, 256, 8, 3) 88.4, (4, 256, 2, 4) 78.8)",
        ),
        (ANY, ANY): Entry(
            RowTiles(32, 256, 8, 3, in_flight=1, splits=3),
            f"{_SPLITS}: 8.97 -> 8.79 ms at batch 8, 24.69 -> 24.65 at 32 (2 splits 8.92 / 24.72); "
            f"{_FLASH_ROWS}, the per-expert loop: 329.1 us at 8 tokens against 384.8 for (8, 512, 4, 3); 2-7 tokens "
            f"not measured; {_IN_FLIGHT}: one expert after the other",
        ),
    }
)
SELECT_EXPERTS = _gpu(
    {
        (ANY, ANY): Entry(
            SelectTiles(num_warps=1),
            f"{_ROUTED}: expert selection, column 'kernel (1 token, 1 warp)' (the row-kernel before the [G, P] "
            "one of 2026-12-05, which is not swept yet)",
        )
    }
)
