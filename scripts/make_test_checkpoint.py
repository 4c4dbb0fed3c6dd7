"""Build a HF-format Ling test checkpoint: block FP8 (optionally MXFP4 routed experts) as spec §6.2 / §6.3,
split into N safetensors shards with model.safetensors.index.json.

    python scripts/make_test_checkpoint.py --preset tiny --out /tmp/tiny-fp8 --shards 3 --mxfp4-experts
    python scripts/make_test_checkpoint.py --config my/config.json --out /tmp/ckpt --random-codes
    python scripts/make_test_checkpoint.py --from-hf-dir /tmp/oracle --out /tmp/oracle-fp8
"""

from __future__ import annotations

import argparse
import os
import sys

from convert.hf_writer import MXFP4_SCALE_FORMATS  # noqa: E402
from convert.synthetic import write_quantized_copy, write_random_checkpoint  # noqa: E402
from ling_jax.config import LingConfig  # noqa: E402
from ling_jax.presets import (
    PRESETS,  # noqa: E402
    preset,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=sorted(PRESETS), help="random weights for a preset config")
    source.add_argument("--config", help="random weights for this config.json (file or directory)")
    source.add_argument("--from-hf-dir", help="quantise this unquantised HF checkpoint (e.g. save_pretrained)")
    parser.add_argument("--out", required=True, help="directory to write")
    parser.add_argument("--shards", type=int, default=4, help="number of safetensors shards (default 4)")
    parser.add_argument("--mxfp4-experts", action="store_true", help="routed experts in MXFP4 (spec §6.3)")
    parser.add_argument(
        "--mxfp4-scale-format",
        choices=MXFP4_SCALE_FORMATS,
        default="e8m0",
        help="MXFP4 scale storage: float8_e8m0fnu, fp32 powers of two, or raw uint8 exponents",
    )
    parser.add_argument("--seed", type=int, default=0, help="random weights' seed")
    parser.add_argument(
        "--random-codes",
        action="store_true",
        help="draw FP8/MXFP4 weights as random codes instead of quantising Gaussian weights "
        "(fast: for multi-GB benchmark checkpoints)",
    )
    args = parser.parse_args(argv)
    if args.shards < 1:
        parser.error(f"--shards must be at least 1, got {args.shards}")
    if args.from_hf_dir and args.random_codes:
        parser.error("--random-codes draws random weights; it does not apply to --from-hf-dir")
    if os.path.exists(args.out) and os.listdir(args.out):
        parser.error(f"--out {args.out} exists and is not empty")
    common = dict(num_shards=args.shards, mxfp4_experts=args.mxfp4_experts, scale_format=args.mxfp4_scale_format)
    if args.from_hf_dir:
        write_quantized_copy(args.from_hf_dir, args.out, **common)
    else:
        config = preset(args.preset) if args.preset else LingConfig.from_pretrained(args.config)
        write_random_checkpoint(args.out, config, seed=args.seed, random_codes=args.random_codes, **common)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
