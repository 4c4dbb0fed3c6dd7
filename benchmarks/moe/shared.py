"""What the MoE benchmarks share: the flags that choose the measurement (every benchmark's parser starts from
them, so `python -m benchmarks.moe --help` and each measurement's help list them), the SwiGLU clip and the nudge
that chains calls."""

from __future__ import annotations

import argparse

LIMIT = 7.0  # Ling's expert SwiGLU clip
FORMATS = ("bf16", "fp8", "mxfp4")


def selection_parser(description: str | None = None, *, add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.moe",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=add_help,
    )
    choose = parser.add_argument_group("which measurement (docs/benchmarks/moe.md lists each)")
    choose.add_argument(
        "--format",
        nargs="+",
        choices=FORMATS,
        default=["bf16"],
        help="expert storage: bf16 (default) times the whole layer; fp8 and / or mxfp4 time the routed experts "
        "of those formats beside bf16 (prefill and decode rows)",
    )
    choose.add_argument(
        "--fp8-matmul",
        choices=("weight_only", "w8a8"),
        default="weight_only",
        help="w8a8: the routed experts in FP8 x FP8 (Triton and Mosaic kernels) against the bf16 fused path",
    )
    choose.add_argument(
        "--path",
        choices=("grouped", "rows"),
        help="grouped: the fused grouped kernels only; rows: the row-by-row decode kernels only (bf16: against "
        "the grouped path, with a tile sweep and the expert selection); default: the format's whole benchmark",
    )
    choose.add_argument(
        "--devices",
        type=int,
        default=1,
        help="N > 1: the layer with its experts over N devices (mesh expert=N), split into its stages, and the "
        "sharded decode step",
    )
    choose.add_argument(
        "--grouped-matmul-sweep",
        action="store_true",
        help="the unfused path's grouped matmul alone: a tile sweep at decode sizes",
    )
    return parser


def nudge_x(x_TD, y_TD):
    return x_TD + (1e-3 * y_TD).astype(x_TD.dtype)
