"""Benchmark ling-convert: throughput and peak RSS on synthetic multi-GB block-FP8 checkpoints.

    python -m benchmarks.convert --sizes-gb 2 6 --workdir /tmp/bench_convert
    python -m benchmarks.convert --quick    # the tiny preset's checkpoint, one fp8 conversion (smoke test)

For each size it writes a checkpoint of `convert.synthetic.benchmark_config` (random FP8 codes), then runs the
converter as a child process (`python -m convert.cli`) per --dtype / --workers combination and reports wall
time, source bytes read per second and the child's own peak RSS (`convert.measure`). Everything it
writes is deleted afterwards. The source was just written, so it is read from the page cache.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from convert.measure import run_measured  # noqa: E402
from convert.synthetic import benchmark_config, write_random_checkpoint  # noqa: E402
from ling_jax.presets import preset  # noqa: E402


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def run_converter(args: list[str]) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, stdout) of one `python -m convert.cli` child."""
    run = run_measured([sys.executable, "-m", "convert.cli", *args, "--quiet"], cwd=ROOT)
    if run.returncode:
        raise RuntimeError(f"ling-convert failed:\n{run.stderr}")
    return run.seconds, run.peak_rss, run.stdout.strip()


_RESTORE = """
import sys, time
start = time.perf_counter()
from ling_jax.checkpoints.orbax import load_checkpoint
import jax
model = load_checkpoint(sys.argv[1])
jax.block_until_ready(jax.tree.leaves(model))
print(f"{time.perf_counter() - start:.1f}")
"""


def time_restore(dst: str) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of `load_checkpoint(dst)` in a fresh process, imports included."""
    run = run_measured([sys.executable, "-c", _RESTORE, dst], cwd=ROOT)
    if run.returncode:
        raise RuntimeError(f"load_checkpoint failed:\n{run.stderr}")
    return float(run.stdout.strip().splitlines()[-1]), run.peak_rss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[2.0, 6.0])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    parser.add_argument("--workers", type=int, nargs="+", default=[2])
    parser.add_argument("--verify", action="store_true", help="also time a bf16 conversion with --verify")
    parser.add_argument("--restore", action="store_true", help="also time load_checkpoint of each --dtype result")
    parser.add_argument("--workdir", default="/tmp/bench_convert")
    parser.add_argument("--quick", action="store_true", help="the tiny preset's checkpoint instead of --sizes-gb")
    args = parser.parse_args(argv)
    sources = (
        [("tiny", preset("tiny"), 2)]
        if args.quick
        else [(f"{size:g}gb", benchmark_config(size * 1e9), max(2, round(size))) for size in args.sizes_gb]
    )
    print(
        "| source | dtype | workers | wall s | read GB/s (wall) | write-phase GB/s | written GB | peak RSS MB "
        "| restore s (RSS MB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, config, shards in sources:
        src = os.path.join(args.workdir, f"src-{name}")
        shutil.rmtree(args.workdir, ignore_errors=True)
        write_random_checkpoint(src, config, num_shards=shards, random_codes=True)
        source_bytes = directory_bytes(src)
        runs = [(dtype, workers, False) for dtype in args.dtypes for workers in args.workers]
        runs += [("bf16", args.workers[0], True)] if args.verify else []
        for dtype, workers, verify in runs:
            dst = os.path.join(args.workdir, "dst")
            seconds, peak, stdout = run_converter(
                [src, dst, "--dtype", dtype, "--workers", str(workers), *(["--verify"] if verify else [])]
            )
            phase_rate = stdout.split("(")[-1].split(" GB/s")[0]
            restore = ""
            if args.restore and workers == args.workers[-1] and not verify:
                restore_seconds, restore_peak = time_restore(dst)
                restore = f"{restore_seconds:.1f} ({restore_peak / 2**20:.0f})"
            print(
                f"| {source_bytes / 1e9:.2f} GB | {dtype}{' --verify' if verify else ''} | {workers} | "
                f"{seconds:.1f} | {source_bytes / seconds / 1e9:.2f} | {phase_rate} | "
                f"{directory_bytes(dst) / 1e9:.2f} | {peak / 2**20:.0f} | {restore} |",
                flush=True,
            )
            shutil.rmtree(dst)
    shutil.rmtree(args.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
