#!/usr/bin/env python3
"""Does a Ling model fit a mesh? Per-device bytes of the prefill chunk and the decode step, compiled ahead of time
for the mesh (`ling_jax.generation.memory_plan`), against the device's memory, with a verdict.

python scripts/memory_plan.py --model ling-3.1-flash --mesh expert=8 --hardware h200 --batch 8 --context 32768
python scripts/memory_plan.py --model /ckpt/Ling-3.0-flash --mesh expert=16,fsdp=4 --hardware v6e --weights bf16

--model is a preset name or a checkpoint directory (its config.json: nothing else is read). On a CPU the mesh's
devices are CPU devices standing in for the accelerators (this script sets
XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts). Exit status 0 when it fits, 1 when it does
not, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

from ling_jax.build import load_model_config, text_config_of  # noqa: E402
from ling_jax.generation.flags import CommandParser, add_mesh_flag, parse_mesh_flag, positive_int
from ling_jax.generation.memory_plan import HARDWARE, plan_memory  # noqa: E402
from ling_jax.presets import PRESETS, preset  # noqa: E402


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help=f"a preset ({', '.join(sorted(PRESETS))}) or a checkpoint")
    add_mesh_flag(parser, default="")
    parser.add_argument("--hardware", required=True, choices=sorted(HARDWARE), help="the accelerator of every device")
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences generated together (default: 1)")
    parser.add_argument("--context", type=positive_int, default=32768, help="cache length in tokens (default: 32768)")
    parser.add_argument("--prefill-chunk", type=positive_int, default=2048, help="prefill chunk (default: 2048)")
    parser.add_argument(
        "--weights",
        choices=("stored", "bf16"),
        default="stored",
        help="stored (default): block FP8 as the published checkpoints hold them; bf16: dense bfloat16",
    )
    parser.add_argument(
        "--memory-fraction", type=fraction, help="usable share of the device's memory (default: the hardware's)"
    )
    parser.add_argument("--whole-model", action="store_true", help="compile all layers, not one of each kind")
    return parser


def model_config(parser: argparse.ArgumentParser, model: str):
    if model in PRESETS:
        return preset(model)
    if not os.path.isdir(model):
        parser.error(f"--model {model}: not a preset ({', '.join(sorted(PRESETS))}) nor a checkpoint directory")
    try:
        return text_config_of(load_model_config(model))
    except (OSError, ValueError) as e:
        parser.error(f"--model {model}: {e}")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        mesh_shape = parse_mesh_flag(args.mesh)
    except ValueError as e:
        parser.error(str(e))
    if args.prefill_chunk > args.context:
        parser.error(f"--prefill-chunk {args.prefill_chunk} exceeds --context {args.context}")
    config = model_config(parser, args.model)
    # read when jax starts its backend (the first device query, in plan_memory): CPU devices standing in
    flag = f"--xla_force_host_platform_device_count={math.prod(mesh_shape.values())}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    hardware = HARDWARE[args.hardware]
    if args.memory_fraction is not None:
        hardware = dataclasses.replace(hardware, usable_fraction=args.memory_fraction, source="--memory-fraction")
    try:
        plan = plan_memory(
            config,
            mesh_shape,
            hardware,
            batch=args.batch,
            context=args.context,
            prefill_chunk=args.prefill_chunk,
            weights=args.weights,
            model_name=args.model,
            whole_model=args.whole_model,
        )
    except ValueError as e:  # ShardingError too
        parser.error(f"--mesh {args.mesh or '(one device)'}: {e}")
    print(plan.report())
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
