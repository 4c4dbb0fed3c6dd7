#!/usr/bin/env python3
"""Where a profiled program's device time goes: kernels of a Perfetto trace grouped by name.

    python -m benchmarks.generate --decode-only --batches 1 --profile /tmp/prof   # on the GPU machine
    python scripts/trace_summary.py /tmp/prof --steps 5                              # anywhere

Reads `perfetto_trace.json.gz` (the newest one under the given directory, or the file itself), takes the
complete events of the device processes (`/device:...`), groups kernels by name (repeated launches of one
kernel are one row; with --by-kind every numbered variant too: `input_reduce_fusion_25` and `_33` become
`input_reduce_fusion`), and prints per step (--steps: how many steps the trace holds) the busy time, the
kernel count, the largest kernels and the tail of small ones, the launch-bound part of a decode step.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import re
import sys


def find_trace(path: pathlib.Path) -> pathlib.Path:
    if not path.exists():
        raise SystemExit(f"error: {path} does not exist")
    if path.is_file():
        return path
    traces = sorted(path.rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise SystemExit(f"error: {path}: no perfetto_trace.json.gz below it (benchmarks/generate.py --profile DIR)")
    return traces[-1]


def device_kernels(trace: dict) -> list[dict]:
    """Complete ("X") events of the processes named /device:..., sorted by start."""
    devices = {
        event["pid"]
        for event in trace["traceEvents"]
        if event.get("ph") == "M"
        and event.get("name") == "process_name"
        and event["args"].get("name", "").startswith("/device:")
    }
    return sorted(
        (event for event in trace["traceEvents"] if event.get("ph") == "X" and event["pid"] in devices),
        key=lambda event: event["ts"],
    )


def summarize(kernels: list[dict], steps: int, top: int, small_us: float, by_kind: bool = False) -> str:
    suffix = re.compile(r"[._]\d+$" if by_kind else r"\.\d+$")
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for kernel in kernels:
        by_name[suffix.sub("", kernel["name"])].append(kernel["dur"])
    busy = sum(kernel["dur"] for kernel in kernels)
    lines = [
        f"{len(kernels) / steps:.0f} kernels and {busy / steps:.1f} us of device time per step ({steps} steps)",
        "",
        "| us / step | calls / step | us / call | kernel |",
        "|---|---|---|---|",
    ]
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))
    for name, durations in ranked[:top]:
        lines.append(
            f"| {sum(durations) / steps:.1f} | {len(durations) / steps:.1f} | "
            f"{sum(durations) / len(durations):.1f} | {name} |"
        )
    small = [d for durations in by_name.values() for d in durations if sum(durations) / len(durations) < small_us]
    lines += [
        "",
        f"kernels averaging under {small_us:g} us: {len(small) / steps:.0f} per step, "
        f"{sum(small) / steps:.1f} us per step",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=pathlib.Path, help="a perfetto_trace.json.gz or a directory holding one")
    parser.add_argument("--steps", type=int, default=1, help="steps (calls) the trace covers")
    parser.add_argument("--top", type=int, default=15, help="kernel rows to print")
    parser.add_argument("--small-us", type=float, default=8.0, help="what counts as a small kernel")
    parser.add_argument("--by-kind", action="store_true", help="merge numbered variants of a kernel name")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    path = find_trace(args.trace)
    with gzip.open(path, "rt") as f:
        kernels = device_kernels(json.load(f))
    if not kernels:
        raise SystemExit(f"error: {path}: no device kernels in the trace")
    print(f"{path}\n{summarize(kernels, args.steps, args.top, args.small_us, args.by_kind)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
