#!/usr/bin/env python3
"""Where a profiled program's device time goes: kernels of a Perfetto trace grouped by name, and by layer kind.

    python -m benchmarks.generate --decode-only --batches 1 --profile /tmp/prof   # on the GPU machine
    python scripts/trace_summary.py /tmp/prof --steps 5                              # anywhere

Reads `perfetto_trace.json.gz` (the newest one under the given directory, or the file itself), takes its kernels
(the complete events of the device processes, `/device:...`; on a CPU the XLA ops the host runs), groups them by
name (repeated launches of one kernel are one row; with --by-kind every numbered variant too:
`input_reduce_fusion_25` and `_33` become `input_reduce_fusion`), and prints per step (--steps: how many steps the
trace holds) the busy time, the kernel count, the largest kernels and the tail of small ones, the launch-bound part
of a decode step. Given a directory that also holds the program's HLO text (`program.hlo.txt`, written by
`benchmarks.generate --profile`), it prints the device time per layer kind too (KDA, MLA, MoE / dense FFN,
lm_head / sampling, other: the named scopes of the kernels' HLO ops; with XLA command buffers, of the instructions
each kernel's name and place in the trace match). --by-program: the device time of each program (the kernels' HLO
module) and the time no kernel runs, over the trace's span (a served run: `benchmarks.serve --profile DIR`). The
parser is `benchmarks.trace`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from benchmarks import trace


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=pathlib.Path, help="a perfetto_trace.json.gz or a directory holding one")
    parser.add_argument("--steps", type=int, default=1, help="steps (calls) the trace covers")
    parser.add_argument("--top", type=int, default=15, help="kernel rows to print")
    parser.add_argument("--small-us", type=float, default=8.0, help="what counts as a small kernel")
    parser.add_argument("--by-kind", action="store_true", help="merge numbered variants of a kernel name")
    parser.add_argument(
        "--by-program", action="store_true", help="also the device time per program (HLO module) and the idle time"
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    path = trace.find_trace(args.trace)
    kernels = trace.kernels(trace.load_trace(path))
    if not kernels:
        raise SystemExit(f"error: {path}: no device kernels in the trace")
    print(f"{path}\n{trace.summarize(kernels, args.steps, args.top, args.small_us, args.by_kind)}")
    if args.by_program:
        print(f"\nby program:\n{trace.module_table(kernels)}")
    if (args.trace / trace.HLO_FILE).is_file():
        print(f"\nby layer kind ({args.trace / trace.HLO_FILE}):\n{trace.layer_kind_report(args.trace, args.steps)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
