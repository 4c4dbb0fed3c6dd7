#!/usr/bin/env python3
"""Greedy generation with a Ling 3.x model.

    python scripts/generate.py                         # tiny RANDOM-weight model: checks the install, prints noise
    python scripts/generate.py --model /path/to/hf-checkpoint-dir "token ids: 1 2 3"

Until the tokenizer and demo-model work lands, text is mapped to bytes (id = byte + 3) for the random
default, and a real checkpoint takes prompts as space-separated token ids.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from ling_jax import LingConfig, LingForCausalLM, load_hf_checkpoint  # noqa: E402
from ling_jax.generate import greedy_generate  # noqa: E402

BYTE_OFFSET = 3  # ids 0..2 are pad / eos / spare in the tiny preset


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompts", nargs="*", default=["The quick brown fox"], help="prompts (default: one example)")
    parser.add_argument("--model", help="HF-format checkpoint directory (config.json + safetensors)")
    parser.add_argument("--preset", default="tiny", help="random-init preset when --model is not given")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    parser.add_argument("--seed", type=int, default=0, help="init seed of the random model")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    if args.model:
        model = load_hf_checkpoint(args.model, dtype=dtype)
        try:
            prompts = [[int(t) for t in p.split()] for p in args.prompts]
        except ValueError:
            sys.exit("error: with --model, prompts are space-separated token ids until tokenizer support lands")

        def decode(ids):
            return " ".join(map(str, ids))
    else:
        config = LingConfig.preset(args.preset)
        print(f"NOTE: no --model given: using a RANDOMLY INITIALISED '{args.preset}' model; its output is noise.")
        model = LingForCausalLM(config, rngs=nnx.Rngs(args.seed), dtype=dtype)
        prompts = [[b + BYTE_OFFSET for b in p.encode()] for p in args.prompts]

        def decode(ids):
            return bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < 256 + BYTE_OFFSET).decode(errors="replace")
    outputs, stats = greedy_generate(model, prompts, args.max_new_tokens, eos_ids=model.config.eos_token_ids)
    for prompt, new in zip(args.prompts, outputs):
        print(f"> {prompt}\n{decode(new)!r}")
    print(f"prompt tokens {stats['prompt_tokens']}, generated {stats['generated_tokens']}, "
          f"prefill {stats['prefill_s']:.2f} s (incl. compile), decode {stats['decode_s']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
