#!/usr/bin/env python3
"""Steady-state decode of `scripts/generate.py`'s code path vs the Generator's bare decode programs, per batch size.

    python -m benchmarks.generate_cli            # the demo checkpoint, batch 1 and 32, 48 new tokens
    python -m benchmarks.generate_cli --quick    # the random tiny preset, batch 1 and 2, 20 new tokens (smoke)

CLI: the command `generate.py --max-new-tokens N PROMPT...` is prepared as the script prepares it (flags,
checkpoint, tokenizer, prompts) and run twice, its stdout thrown away; the second run's steady-state decode
(the programs after the first one, `GenerationStats.steady_s / steady_steps`, steps the device ran) is the CLI's
time per step, so it includes host reads, detokenising, stop-string checks and printing; its tok/s counts the
tokens kept (`GenerationStats.decode_tokens_per_s`). The Generator runs DECODE_READ_GROUP (K) decode steps per
jitted program and reads their tokens once per program, the next program already dispatched.

Two bare loops on a cache of the CLI run's length, each dispatched back to back with its token fed back on the
device and one sync at the end (mean per step), the same whole-program steps as the CLI's (N - 1 rounded down to
whole programs): "1-step", one program per step (`_decode_group` with one step: the decode loop before
multi-step programs, one dispatch per token), and "K-step", the K-step program the CLI runs. CLI / K-step is
the CLI's own overhead (goal: <= 1.2x); CLI / 1-step what multi-step programs buy against the one-step loop.

Host: the CLI's host work alone per step, no device involved: the tokens of a real run are replayed through the
Generator's host bookkeeping in its read groups and the CLI's callbacks and printing (stdout thrown away).
Dispatch: the host time per step to launch the bare programs (each loop above before its sync). A loop is
dispatch-bound when its dispatch time per step reaches its step time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ling_jax.cache import LingCache  # noqa: E402
from ling_jax.generation import cli as generate_cli  # noqa: E402
from ling_jax.generation.generator import (  # noqa: E402
    DECODE_READ_GROUP,
    DecodeState,
    GenerationStats,
    _decode_group,
    _Rows,
    cache_length,
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


def cli_step_seconds(model_flags: list[str], batch: int, new_tokens: int) -> tuple[float, float, generate_cli.Run]:
    """Seconds per steady-state decode step and tokens per second of the CLI's second run (the first compiles)."""
    args = generate_cli.build_parser().parse_args([*model_flags, "--max-new-tokens", str(new_tokens), *prompts(batch)])
    run = generate_cli._prepare(args)
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
        run.generate_and_print()
        stats = run.generate_and_print()
    if not stats.steady_steps:
        raise SystemExit(f"batch {batch}: every prompt ended after {stats.generated_tokens} tokens; no steady state")
    return stats.steady_s / stats.steady_steps, stats.decode_tokens_per_s, run


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


def bare_step_seconds(run: generate_cli.Run, program_steps: int) -> tuple[float, float]:
    """Mean seconds per decode step of the run's Generator running programs of `program_steps` steps back to back
    on a cache of the CLI run's length, and the host's seconds per step to dispatch them."""
    generator, batch, new_tokens = run.generator, len(run.prompts), run.args.max_new_tokens
    padded = sum(prefill_chunks(max(map(len, run.prompts)), generator.prefill_chunk))
    cache = LingCache.create(generator.config, batch, cache_length(padded, new_tokens, 0), generator.dtype)
    cache = LingCache(layers=cache.layers, lengths=jnp.full((batch,), padded, jnp.int32))
    seen = jnp.zeros((batch, generator.config.vocab_size), bool)
    state = DecodeState.create(cache, seen).replace(steps_B=jnp.ones((batch,), jnp.int32))
    arrays = SamplingArrays.from_params([run.sampling] * batch)
    # the CLI's steady programs fill at most N - 1 slots; one program of warm-up fits in its cache's slack
    timed = (new_tokens - 1) // DECODE_READ_GROUP * DECODE_READ_GROUP
    if not timed:
        raise SystemExit(f"--new-tokens {new_tokens}: the bare loops need at least {DECODE_READ_GROUP + 1}")

    def run_programs(state, programs):
        for _ in range(programs):
            tokens, state = _decode_group(generator.static, program_steps, generator.leaves, state, arrays)
        return tokens, state

    tokens, state = run_programs(state, DECODE_READ_GROUP // program_steps)
    jax.block_until_ready(tokens)
    start = time.perf_counter()
    tokens, state = run_programs(state, timed // program_steps)
    dispatched = time.perf_counter()
    jax.block_until_ready(tokens)
    return (time.perf_counter() - start) / timed, (dispatched - start) / timed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the random tiny preset, small batches, few tokens")
    parser.add_argument("--model", metavar="PATH", help="a checkpoint directory (default: the demo checkpoint)")
    parser.add_argument("--batches", help="comma-separated batch sizes (default 1,32; --quick: 1,2)")
    parser.add_argument("--new-tokens", type=int, help="tokens per prompt (default 48; --quick: 20)")
    args = parser.parse_args(argv)
    model_flags = ["--model", args.model] if args.model else (["--preset", "tiny"] if args.quick else [])
    batches = [int(b) for b in (args.batches or ("1,2" if args.quick else "1,32")).split(",")]
    new_tokens = args.new_tokens or (20 if args.quick else 48)
    k = DECODE_READ_GROUP
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}; model: "
        f"{' '.join(model_flags) or 'the demo checkpoint'}; {new_tokens} new tokens per prompt; K = {k}",
        flush=True,
    )
    rows = []
    for batch in batches:
        cli_s, cli_rate, run = cli_step_seconds(model_flags, batch, new_tokens)
        one_s, one_dispatch_s = bare_step_seconds(run, 1)
        group_s, group_dispatch_s = bare_step_seconds(run, k)
        host_s = host_step_seconds(run)
        rows.append((batch, cli_s, cli_rate, one_s, group_s, host_s, one_dispatch_s, group_dispatch_s))
        print(
            f"batch {batch}: CLI {cli_s * 1e3:.2f} ms/step ({cli_rate:,.1f} tok/s); bare 1-step {one_s * 1e3:.2f} "
            f"ms/step: {cli_s / one_s:.2f}x; bare {k}-step {group_s * 1e3:.2f} ms/step: {cli_s / group_s:.2f}x; "
            f"host work {host_s * 1e3:.3f} ms/step; dispatch {one_dispatch_s * 1e3:.3f} (1-step), "
            f"{group_dispatch_s * 1e3:.3f} ({k}-step) ms/step",
            flush=True,
        )
    print(
        f"\n| batch | CLI ms/step | CLI tok/s | 1-step ms | CLI / 1-step | {k}-step ms/step | CLI / {k}-step "
        f"| host ms/step | dispatch ms/step, 1-step | dispatch ms/step, {k}-step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for batch, cli_s, cli_rate, one_s, group_s, host_s, one_dispatch_s, group_dispatch_s in rows:
        print(
            f"| {batch} | {cli_s * 1e3:.2f} | {cli_rate:,.1f} | {one_s * 1e3:.2f} | {cli_s / one_s:.2f}x "
            f"| {group_s * 1e3:.2f} | {cli_s / group_s:.2f}x | {host_s * 1e3:.3f} | {one_dispatch_s * 1e3:.3f} "
            f"| {group_dispatch_s * 1e3:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
