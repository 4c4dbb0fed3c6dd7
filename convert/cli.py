"""ling-convert SRC DST [--dtype bf16|fp8] [--mesh AXES] [--workers N] [--resume] [--verify] [--overwrite]
[--allow-nonfinite] [--distributed [--coordinator HOST:PORT --num-processes N --process-id I]]

A refused input (a flag, SRC, DST, a damaged file) ends it with one `ling-convert: error: ...` line and status 2,
as argparse's usage errors; an unexpected failure is a traceback and status 1. Ctrl-C ends it with one line and
status 130 wherever it comes, the seconds spent importing JAX included (the
pipeline is imported inside `main`): the journal keeps what was finished for `--resume`.
"""

from __future__ import annotations

import argparse
import os
import sys

from convert import BF16, FP8_KEPT, ConvertError
from ling_jax import distributed

INTERRUPTED = "ling-convert: interrupted; run the same command with --resume to continue"
INTERRUPTED_STATUS = 130  # 128 + SIGINT, as shells report it
INPUT_ERROR_STATUS = 2  # a bad flag or input file, as argparse's usage errors; 1 is left to a crash (a traceback)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ling-convert",
        description="Convert a HF-format Ling checkpoint (config.json + safetensors shards, block FP8 / MXFP4) "
        "into an Orbax checkpoint for ling_jax.load_checkpoint, streaming tensor by tensor.",
    )
    parser.add_argument("src", help="HF checkpoint directory (config.json, model.safetensors.index.json, shards)")
    parser.add_argument("dst", help="Orbax checkpoint directory to create")
    parser.add_argument(
        "--dtype",
        choices=(BF16, FP8_KEPT),
        default=BF16,
        help="bf16 (default): dequantise everything (A_log, dt_bias, convs, expert bias stay fp32); "
        "fp8: keep FP8 weights and MXFP4 experts (as FP8 codes) with their block scales",
    )
    parser.add_argument(
        "--mesh",
        metavar="AXES",
        help="target mesh, e.g. 'tensor=2,expert=4': refuse a model it does not fit, cut the stored "
        "chunks to the rows each device will hold, record it in ling_convert.json",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=min(4, os.cpu_count() or 1),
        metavar="N",
        help="slices read, converted and written in parallel (default: min(4, CPUs))",
    )
    parser.add_argument("--resume", action="store_true", help="continue a killed conversion to DST")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="re-read DST and compare it bit for bit with SRC, rejecting NaN/Inf, before publishing",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DST when it is an earlier ling-convert output (never a directory of other "
        "files), and discard an unfinished conversion to it; the old output is deleted only "
        "once the new one is in place",
    )
    parser.add_argument(
        "--allow-nonfinite", action="store_true", help="convert tensors holding NaN or Inf instead of refusing them"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars (default: on stderr)")
    distributed.add_arguments(
        parser,
        "multi-host: join the jax.distributed job first; each process converts the tensors it owns, process 0 "
        "merges them (SRC and DST on a filesystem every process shares; docs/multihost.md)",
    )
    return parser


def _run(args: argparse.Namespace) -> int:
    from convert.pipeline import Cluster, Options, convert
    from ling_jax.generation.flags import parse_mesh_flag

    try:
        distributed.check_arguments(args)
        cluster = Cluster()
        if args.distributed:
            distributed.join(args, "ling-convert: ")
            cluster = Cluster.jax_distributed(args.distributed_timeout)
        mesh = parse_mesh_flag(args.mesh) if args.mesh else None
        options = Options(
            dtype=args.dtype,
            workers=args.workers,
            resume=args.resume,
            verify=args.verify,
            overwrite=args.overwrite,
            progress=not args.quiet,
            mesh=mesh,
            allow_nonfinite=args.allow_nonfinite,
        )
        summary = convert(args.src, args.dst, options, cluster)
    except (ConvertError, ValueError, OSError) as e:
        print(f"ling-convert: error: {e}", file=sys.stderr)
        return INPUT_ERROR_STATUS
    rate = summary.bytes_read / summary.seconds / 1e9 if summary.seconds else 0.0
    resumed = f", {summary.resumed} finished earlier" if summary.resumed else ""
    verified = ", verified" if summary.verified else ""
    print(
        f"ling-convert: {args.dst}: {summary.converted} parameters{resumed}; read {summary.bytes_read / 1e9:.2f} GB "
        f"in {summary.seconds:.1f} s ({rate:.2f} GB/s){verified}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    try:
        return _run(args)
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return INTERRUPTED_STATUS


if __name__ == "__main__":
    sys.exit(main())
