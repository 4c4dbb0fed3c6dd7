#!/usr/bin/env python3
"""Steady-state decode of `scripts/generate.py`'s code path vs the Generator's bare decode step, per batch size.

    python scripts/bench_generate_cli.py            # the demo checkpoint, batch 1 and 32, 48 new tokens
    python scripts/bench_generate_cli.py --quick    # the random tiny preset, batch 1 and 2, 8 new tokens (smoke)

CLI: the command `generate.py --max-new-tokens N PROMPT...` is prepared as the script prepares it (flags,
checkpoint, tokenizer, prompts) and run twice, its stdout thrown away; the second run's steady-state decode
(the steps after the first one, `GenerationStats.steady_s / steady_steps`) is the CLI's time per step, so it
includes host reads, detokenising, stop-string checks and printing. Bare: the same Generator's jitted decode
step on a cache of the same length, dispatched back to back with its token fed back on the device and one
sync at the end (mean per step). The ratio is CLI / bare (goal: <= 1.2x).

Host: the CLI's host work alone per step, no device involved: the tokens of a real run are replayed through the
Generator's host bookkeeping in its read groups (`DECODE_READ_GROUP`) and the CLI's callbacks and printing
(stdout thrown away). Dispatch: the host time to launch one bare step (the loop above before its sync). The
CLI keeps its host work off the device's critical path while host + dispatch stay below the bare step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ling_jax.cache import LingCache  # noqa: E402
from ling_jax.generation import cli as generate_cli  # noqa: E402
from ling_jax.generation.generator import (  # noqa: E402
    CACHE_BUCKET,
    DECODE_READ_GROUP,
    GenerationStats,
    _decode_step,
    _Rows,
    prefill_chunks,
)
from ling_jax.generation.sampling import SamplingArrays  # noqa: E402

PROMPT_WORDS = (
    "Mr. Darcy",
    "Elizabeth",
    "It is a truth",
    "Emma Woodhouse",
    "The weather",
    "Her sister",
    "A letter",
    "At Netherfield",
)


def prompts(batch: int) -> list[str]:
    return [f"{PROMPT_WORDS[i % len(PROMPT_WORDS)]} {i}" for i in range(batch)]


def cli_step_seconds(model_flags: list[str], batch: int, new_tokens: int) -> tuple[float, generate_cli.Run]:
    """Seconds per steady-state decode step of the CLI's second run (the first compiles)."""
    args = generate_cli.build_parser().parse_args([*model_flags, "--max-new-tokens", str(new_tokens), *prompts(batch)])
    run = generate_cli._prepare(args)
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
        run.generate_and_print()
        stats = run.generate_and_print()
    if not stats.steady_steps:
        raise SystemExit(f"batch {batch}: every prompt ended after {stats.generated_tokens} tokens; no steady state")
    return stats.steady_s / stats.steady_steps, run


class Replay:
    """Stands in for the Generator: hands `tokens_BN` (a real run's tokens, EOS-padded) to the callbacks as the
    Generator does, the first token alone and then DECODE_READ_GROUP steps at a time; only the host works."""

    def __init__(self, tokens_BN: np.ndarray):
        self.tokens_BN = tokens_BN

    def generate(self, prompts, sampling, max_new_tokens, *, eos_ids=(), on_tokens=None, media=None):
        columns = list(self.tokens_BN.T)
        rows = _Rows(len(prompts), max_new_tokens, eos_ids, on_tokens)
        rows.add(columns[0][:, None])
        start, read = time.perf_counter(), 1
        while read < max_new_tokens and not rows.done.all():
            group = min(DECODE_READ_GROUP, max_new_tokens - read)
            rows.add(np.stack(columns[read : read + group], axis=1))
            read += group
        host_s = time.perf_counter() - start
        stats = GenerationStats(sum(map(len, prompts)), rows.generated, 0.0, host_s, 0.0)
        stats.steady_steps, stats.steady_tokens, stats.steady_s = read - 1, rows.generated - len(prompts), host_s
        return rows.tokens, stats


def host_step_seconds(run: generate_cli.Run, repeats: int = 5) -> float:
    """The CLI's host work per decode step (best of `repeats`), on the tokens the run's model generates."""
    new_tokens, eos = run.args.max_new_tokens, run.tokenizer.eos_ids
    outputs, _ = run.generator.generate(run.prompts, [run.sampling] * len(run.prompts), new_tokens, eos_ids=eos)
    tokens_BN = np.full((len(outputs), new_tokens), eos[0] if eos else 0, np.int64)
    for row, ids in enumerate(outputs):
        tokens_BN[row, : len(ids)] = ids
    replay = dataclasses.replace(run, generator=Replay(tokens_BN))
    best = float("inf")
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
        for _ in range(repeats):
            stats = replay.generate_and_print()
            best = min(best, stats.steady_s / max(stats.steady_steps, 1))
    return best


def bare_step_seconds(run: generate_cli.Run, steps: int) -> tuple[float, float]:
    """Mean seconds per `_decode_step` of the run's Generator, back to back, on a cache of the CLI run's length,
    and the host's seconds per step to dispatch them."""
    generator, batch = run.generator, len(run.prompts)
    padded = sum(prefill_chunks(max(map(len, run.prompts)), generator.prefill_chunk))
    length = -(-(padded + run.args.max_new_tokens + 1) // CACHE_BUCKET) * CACHE_BUCKET
    cache = LingCache.create(generator.config, batch, length, generator.dtype)
    cache = LingCache(layers=cache.layers, lengths=jnp.full((batch,), padded, jnp.int32))
    seen = jnp.zeros((batch, generator.config.vocab_size), bool)
    token, counter = jnp.zeros((batch,), jnp.int32), jnp.ones((batch,), jnp.int32)
    arrays = SamplingArrays.from_params([run.sampling] * batch)

    def step(cache, seen, token, counter):
        return _decode_step(generator.static, generator.leaves, cache, seen, token, arrays, counter)

    for _ in range(3):
        token, cache, seen, counter = step(cache, seen, token, counter)
    jax.block_until_ready(token)
    start = time.perf_counter()
    for _ in range(steps):
        token, cache, seen, counter = step(cache, seen, token, counter)
    dispatched = time.perf_counter()
    jax.block_until_ready(token)
    return (time.perf_counter() - start) / steps, (dispatched - start) / steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the random tiny preset, small batches, few tokens")
    parser.add_argument("--model", metavar="PATH", help="a checkpoint directory (default: the demo checkpoint)")
    parser.add_argument("--batches", help="comma-separated batch sizes (default 1,32; --quick: 1,2)")
    parser.add_argument("--new-tokens", type=int, help="tokens per prompt (default 48; --quick: 8)")
    args = parser.parse_args(argv)
    model_flags = ["--model", args.model] if args.model else (["--preset", "tiny"] if args.quick else [])
    batches = [int(b) for b in (args.batches or ("1,2" if args.quick else "1,32")).split(",")]
    new_tokens = args.new_tokens or (8 if args.quick else 48)
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}; model: "
        f"{' '.join(model_flags) or 'the demo checkpoint'}; {new_tokens} new tokens per prompt",
        flush=True,
    )
    rows = []
    for batch in batches:
        cli_s, run = cli_step_seconds(model_flags, batch, new_tokens)
        bare_s, dispatch_s = bare_step_seconds(run, max(new_tokens, 8))
        host_s = host_step_seconds(run)
        rows.append((batch, cli_s, bare_s, host_s, dispatch_s))
        print(
            f"batch {batch}: CLI {cli_s * 1e3:.2f} ms/step ({batch / cli_s:,.1f} tok/s), bare step "
            f"{bare_s * 1e3:.2f} ms ({batch / bare_s:,.1f} tok/s): {cli_s / bare_s:.2f}x; host work "
            f"{host_s * 1e3:.3f} ms/step, dispatch {dispatch_s * 1e3:.3f} ms/step",
            flush=True,
        )
    print("\n| batch | CLI ms/step | CLI tok/s | bare step ms | ratio | host ms/step | dispatch ms/step |")
    print("|---|---|---|---|---|---|---|")
    for batch, cli_s, bare_s, host_s, dispatch_s in rows:
        print(
            f"| {batch} | {cli_s * 1e3:.2f} | {batch / cli_s:,.1f} | {bare_s * 1e3:.2f} | {cli_s / bare_s:.2f}x "
            f"| {host_s * 1e3:.3f} | {dispatch_s * 1e3:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
