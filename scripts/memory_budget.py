#!/usr/bin/env python3
"""Decode-cache memory budget of a Ling 3.x config (KDA states, conv windows, absorbed vs expanded MLA cache).

python scripts/memory_budget.py                                   # ling-3.1-flash, batch 1, 262144 tokens
python scripts/memory_budget.py --preset ling-3.0-flash --batch 8 --context 32768
python scripts/memory_budget.py --config /path/to/checkpoint-dir  # or a config.json file
"""

from __future__ import annotations

import argparse
import sys

from ling_jax.config import LingConfig  # noqa: E402
from ling_jax.generation.flags import CommandParser, positive_int
from ling_jax.generation.memory import cache_budget  # noqa: E402
from ling_jax.presets import PRESETS, preset  # noqa: E402

DTYPES = ("bfloat16", "float16", "float32")


def parse_args(argv=None):
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=sorted(PRESETS), help="a built-in config (default: ling-3.1-flash)")
    source.add_argument("--config", help="a checkpoint directory or its config.json")
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences decoded together (default: 1)")
    parser.add_argument(
        "--context", type=positive_int, default=262144, help="cache length in tokens per sequence (default: 262144)"
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="bfloat16",
        help="activation / cache dtype (default: bfloat16; the KDA state is always float32)",
    )
    args = parser.parse_args(argv)
    if args.config:
        try:
            args.model_config = LingConfig.from_pretrained(args.config)
        except (OSError, ValueError) as e:
            parser.error(f"--config: {e}")
        args.source = args.config
    else:
        args.source = args.preset or "ling-3.1-flash"
        args.model_config = preset(args.source)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    budget = cache_budget(args.model_config, args.batch, args.context, args.dtype)
    print(f"config: {args.source}")
    if args.context > args.model_config.max_position_embeddings:
        print(
            f"NOTE: context {args.context:,} exceeds max_position_embeddings "
            f"{args.model_config.max_position_embeddings:,}"
        )
    print(budget.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
