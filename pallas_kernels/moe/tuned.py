"""Launch settings of the MoE kernels, keyed by (device kind, shape bucket, dtype) (`pallas_kernels.tuning`).

Buckets of the grouped kernels: "few_rows" (decode: the groups average at most FEW_ROWS_PER_GROUP rows, so each
call streams the picked experts' weights) and "many_rows" (`rows_bucket`). The GPU entries were measured on an
H200 at hidden 4096, 512 experts, top-8, width 1024, bf16 (the Ling-3.1-flash preset before its published widths;
the published expert width is 1280); other GPUs take the same values (the ANY entries). fp32 (IEEE products, no
tensor cores) is untuned: its entries are the 16-bit ones shrunk to fit, not measured.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.tuning import ANY, H200, Entry

FEW_ROWS_PER_GROUP = 4


def rows_bucket(num_rows: int, num_groups: int) -> str:
    return "few_rows" if num_rows <= FEW_ROWS_PER_GROUP * num_groups else "many_rows"


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
    """gpu_triton routed-experts row kernels: block_n output columns a program, block_k a step."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class SelectTiles:
    """gpu_triton expert selection: block_t tokens a program."""

    block_t: int
    num_warps: int


def _gpu(entries: dict) -> dict:
    """The H200's entries {(bucket, dtype): Entry}, also the defaults for every other device."""
    return {(device, *key): entry for key, entry in entries.items() for device in (H200, ANY)}


_FP32 = "fp32 untuned (IEEE products, no tensor cores): smaller tiles, not measured"
GROUPED_MATMUL = _gpu(
    {
        ("many_rows", "16bit"): Entry(
            GroupedTiles(128, 256, 64, 8, 4),
            "BENCHMARKS.md, 'MoE layer', row '8192 | three grouped GEMMs alone' (128x256x64 "
            "tiles: the best of a small sweep at 65536 rows, 512 groups, K 4096, N 1024)",
        ),
        ("few_rows", "16bit"): Entry(
            GroupedTiles(16, 64, 128, 4, 4),
            "BENCHMARKS.md, 'Grouped-matmul tiles at decode sizes': the narrow tiles "
            "(16 x 64 x 128) best or near it at 8 and 64 rows for both shapes",
        ),
        ("many_rows", ANY): Entry(GroupedTiles(64, 64, 32, 4, 3), _FP32),
        ("few_rows", ANY): Entry(GroupedTiles(16, 32, 64, 4, 3), _FP32),
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
_FUSED = "BENCHMARKS.md, MoE layer, 'Fused grouped path (2026-11-29)': the best of scripts/bench_moe.py's sweep"
GATHER_SWIGLU = _gpu(
    {  # two accumulators: half the grouped matmul's column tile
        ("many_rows", "16bit"): Entry(GroupedTiles(128, 128, 64, 8, 4), f"{_FUSED} at 8192 tokens"),
        ("few_rows", "16bit"): Entry(GroupedTiles(32, 64, 128, 4, 4), f"{_FUSED} at 64 tokens"),
        ("many_rows", ANY): Entry(GroupedTiles(64, 32, 32, 4, 3), _FP32),
        ("few_rows", ANY): Entry(GroupedTiles(16, 32, 64, 4, 3), _FP32),
    }
)
DOWN_SCATTER = _gpu(
    {
        ("many_rows", "16bit"): Entry(GroupedTiles(128, 256, 64, 8, 4), f"{_FUSED} at 8192 tokens"),
        ("few_rows", "16bit"): Entry(GroupedTiles(32, 64, 128, 4, 4), f"{_FUSED} at 64 tokens"),
        ("many_rows", ANY): Entry(GroupedTiles(64, 64, 32, 4, 3), _FP32),
        ("few_rows", ANY): Entry(GroupedTiles(16, 32, 64, 4, 3), _FP32),
    }
)
_ROUTED = (
    "BENCHMARKS.md, 'Routed experts and expert selection at decode sizes, chained-call timing (2026-11-29)', "
    "tile sweep at one token"
)
ROUTED_SWIGLU = _gpu({(ANY, ANY): Entry(RowTiles(8, 256, 4, 4), f"{_ROUTED}: SwiGLU rows (8, 256, 4, 4) 74.5 us")})
ROUTED_DOWN = _gpu({(ANY, ANY): Entry(RowTiles(8, 1024, 4, 3), f"{_ROUTED}: the down + combine default stayed")})
SELECT_EXPERTS = _gpu(
    {
        (ANY, ANY): Entry(
            SelectTiles(block_t=1, num_warps=1), f"{_ROUTED}: expert selection, column 'kernel (1 token, 1 warp)'"
        )
    }
)
