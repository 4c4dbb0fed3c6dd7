#!/usr/bin/env python3
"""ling-serve's continuous batching against static batches of `Generator` (what generate.py runs), on the same
requests: output tokens/s and time-to-first-token / time-per-output-token p50 and p99 per concurrency.

    python -m benchmarks.serve            # the full-width 8-layer Ling-3.1-flash slice (7 KDA + 1 MLA,
                                             # 512 experts), random weights stored as the checkpoint stores
                                             # them (block FP8), initialised on the device; concurrency 1, 16, 64
    python -m benchmarks.serve --quick    # a narrow 2-layer model, few short requests (CPU smoke test)
    python -m benchmarks.serve --concurrency 16 --skip-static --profile /tmp/sp   # then:
    python scripts/trace_summary.py /tmp/sp --by-program  # device time per program (decode, prefill, ...), idle time

Requests: a synthetic chat mix (seeded): prompt lengths log-uniform in [--min-prompt, --max-prompt], output
lengths log-uniform in [--min-output, --max-output], greedy (or sampled: --temperature, --top-p), EOS ignored
(every request runs its full length).
Served: the scheduler in-process (no HTTP), `concurrency` closed-loop clients, each submitting its next request
when its previous one ends; TTFT from submission to the first token, TPOT over the rest of the request.
Prefix reuse (`--prefix-tokens`): TTFT of requests sharing a long prefix, one at a time, prefix cache off vs on.
Static: the same requests in order, in batches of `concurrency`, each batch one `Generator.generate` call that
runs to the batch's longest output (a row's tokens past its own length are wasted, as in a static server);
TTFT is the batch's time to its first token, TPOT its decode time per step; tokens/s counts requested
tokens only. Both compile first (served: the engine's warm-up; static: a first pass over the same requests,
not timed), so no figure includes compilation.
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import flash_slice_config  # noqa: E402
from ling_jax import LingForCausalLM  # noqa: E402
from ling_jax.checkpoints.hf import STORED  # noqa: E402
from ling_jax.generation import cli_runtime  # noqa: E402
from ling_jax.generation.generator import Generator  # noqa: E402
from ling_jax.generation.random_init import random_model  # noqa: E402
from ling_jax.generation.sampling import SamplingParams  # noqa: E402
from ling_jax.generation.tokenizer import load_tokenizer  # noqa: E402
from ling_jax.serving.engine import DECODE_STEPS, PAGE_SIZE, Engine, prefix_block_bytes  # noqa: E402
from ling_jax.serving.prefix_cache import PrefixCache  # noqa: E402
from ling_jax.serving.scheduler import Request, Scheduler  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
QUICK_DEFAULTS = {  # flag: ((default, with --quick), meaning)
    "--min-prompt": ((64, 8), "shortest prompt, tokens"),
    "--max-prompt": ((2048, 40), "longest prompt, tokens"),
    "--min-output": ((16, 2), "shortest output, tokens"),
    "--max-output": ((256, 12), "longest output, tokens"),
    "--prefill-chunk": ((512, 32), "prefill chunk"),
    "--prefill-budget": ((2048, 64), "served: prompt tokens per prefill step"),
}


def workload(count: int, args, seed: int) -> list[tuple[list[int], int]]:
    """`count` (prompt ids, output length) pairs, log-uniform lengths."""
    rng = np.random.default_rng(seed)

    def lengths(low: int, high: int) -> np.ndarray:
        return np.exp(rng.uniform(np.log(low), np.log(high + 1), count)).astype(int).clip(low, high)

    prompts, outputs = lengths(args.min_prompt, args.max_prompt), lengths(args.min_output, args.max_output)
    vocab = args.vocab
    return [(rng.integers(0, vocab, p).tolist(), int(o)) for p, o in zip(prompts, outputs)]


def percentiles(values: list[float]) -> tuple[float, float]:
    return (float(np.percentile(values, 50)), float(np.percentile(values, 99))) if values else (np.nan, np.nan)


def run_served(scheduler: Scheduler, requests, concurrency: int, sampling: SamplingParams = GREEDY) -> dict:
    """Closed loop: `concurrency` clients, each sending its next request (with `sampling`) when the last one
    ends."""
    pending = list(reversed(requests))
    lock, all_done = threading.Lock(), threading.Event()
    ttft, tpot, tokens, live = [], [], [0], [0]

    def send() -> None:
        prompt, max_tokens = pending.pop()
        submitted = time.perf_counter()
        state = {"first": None, "count": 0}

        def emit(delta) -> None:
            now = time.perf_counter()
            state["count"] += len(delta.token_ids)
            if state["first"] is None and delta.token_ids:
                state["first"] = now
                ttft.append(now - submitted)
            if delta.finish is not None:
                if state["count"] > 1:
                    tpot.append((now - state["first"]) / (state["count"] - 1))
                with lock:
                    tokens[0] += state["count"]
                    live[0] -= 1
                    if pending:
                        live[0] += 1
                        send()
                    elif live[0] == 0:
                        all_done.set()

        scheduler.submit(Request(prompt=prompt, sampling=sampling, max_tokens=max_tokens, emit=emit))

    start = time.perf_counter()
    with lock:
        for _ in range(min(concurrency, len(pending))):
            live[0] += 1
            send()
    all_done.wait()
    wall = time.perf_counter() - start
    return {"tokens_per_s": tokens[0] / wall, "ttft": percentiles(ttft), "tpot": percentiles(tpot), "wall": wall}


def run_static(generator: Generator, requests, batch: int, sampling: SamplingParams = GREEDY) -> dict:
    ttft, tpot, useful = [], [], 0
    start = time.perf_counter()
    for first in range(0, len(requests), batch):
        group = requests[first : first + batch]
        longest = max(o for _, o in group)
        _, stats = generator.generate([p for p, _ in group], [sampling] * len(group), longest)
        useful += sum(o for _, o in group)
        ttft += [stats.ttft_s] * len(group)
        if longest > 1:
            tpot += [stats.decode_s / (longest - 1)] * len(group)
    wall = time.perf_counter() - start
    return {"tokens_per_s": useful / wall, "ttft": percentiles(ttft), "tpot": percentiles(tpot), "wall": wall}


def run_prefix(model, args) -> tuple[float, float]:
    """Median TTFT (s) of requests sharing a `--prefix-tokens` prefix (each with 32 tokens of its own), one at a
    time, without and with the prefix cache (after a first request has filled it)."""
    block = args.prefill_chunk
    blocks = -(-(args.prefix_tokens + 64) // block)
    cache_bytes = 2 * blocks * prefix_block_bytes(model.config, block, model.dtype, mtp=0)  # the prefix twice over
    engine = Engine(
        model,
        max_batch=1,
        max_context=args.prefix_tokens + 64,
        prefill_chunk=block,
        prefill_budget=args.prefill_budget,
        page_size=math.gcd(block, PAGE_SIZE),
        prefix_cache_bytes=cache_bytes,
    )
    engine.warm_up()
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, args.vocab, args.prefix_tokens).tolist()
    prompts = [prefix + rng.integers(0, args.vocab, 32).tolist() for _ in range(6)]
    medians = []
    for cache in (None, PrefixCache(engine.pages, block, cache_bytes)):
        scheduler = Scheduler(engine, load_tokenizer(None, model.config), eos_ids=(), max_queue=1, prefix_cache=cache)
        times = []
        for prompt in prompts:
            start = time.perf_counter()
            scheduler.submit(Request(prompt=prompt, sampling=GREEDY, max_tokens=1, emit=lambda d: None))
            while scheduler.waiting or any(scheduler.slots):
                scheduler._step()
            times.append(time.perf_counter() - start)
        medians.append(float(np.median(times[1:])))  # the first request compiles nothing but fills the cache
    if len(cache) < args.prefix_tokens // block:
        raise RuntimeError(f"the prefix cache holds {len(cache)} blocks after the run, not the prefix's")
    return medians[0], medians[1]


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, with --quick's values where a flag is not given; a bad value is argparse's usage error."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a narrow model, a few short requests (CPU)")
    parser.add_argument("--concurrency", help="comma-separated client counts (default 1,16,64; --quick 1,3)")
    parser.add_argument("--requests", type=int, default=0, help="requests per concurrency (default 2x it, >= 8)")
    for flag, ((default, quick), meaning) in QUICK_DEFAULTS.items():
        parser.add_argument(flag, type=int, help=f"{meaning} (default {default}; --quick {quick})")
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=DECODE_STEPS,
        help=f"served: decode steps per program when nothing waits (default {DECODE_STEPS})",
    )
    parser.add_argument(
        "--general-sampling",
        action="store_true",
        help="served: decode with the programs for any sampling parameters only (Engine(plain_greedy_programs="
        "False)), not the plain-greedy ones a GPU's warm-up adds",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request's sampling temperature (default 0: greedy; above 0 the requests sample, seeded, and the "
        "server runs its decode programs for any sampling parameters)",
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's top-p (default 1: off)")
    parser.add_argument("--skip-static", action="store_true", help="the served runs only")
    parser.add_argument(
        "--profile",
        help="trace the last concurrency's timed served run with the JAX profiler into this directory "
        "(`scripts/trace_summary.py DIR --by-program`: device time per program and the idle time)",
    )
    parser.add_argument(
        "--prefix-tokens",
        type=int,
        help="TTFT of requests sharing a prefix this long, prefix cache off vs on (default 8192, --quick 96; 0: skip)",
    )
    args = parser.parse_args(argv)
    args.concurrency = args.concurrency or ("1,3" if args.quick else "1,16,64")
    if args.prefix_tokens is None:
        args.prefix_tokens = 96 if args.quick else 8192
    for flag, (defaults, _) in QUICK_DEFAULTS.items():  # a flag given wins over --quick's value
        name = flag.removeprefix("--").replace("-", "_")
        if getattr(args, name) is None:
            setattr(args, name, defaults[args.quick])
    try:  # before any slow work
        SamplingParams(temperature=args.temperature, top_p=args.top_p)
    except ValueError as error:
        parser.error(str(error))
    if not all(level.strip().isdigit() and int(level) > 0 for level in args.concurrency.split(",")):
        parser.error(f"--concurrency: expected positive integers, comma-separated, got {args.concurrency!r}")
    for low, high in (("--min-prompt", "--max-prompt"), ("--min-output", "--max-output")):
        low_value, high_value = (getattr(args, flag.removeprefix("--").replace("-", "_")) for flag in (low, high))
        if not 0 < low_value <= high_value:
            parser.error(f"{low} {low_value} and {high} {high_value}: expected 0 < {low} <= {high}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    cache_dir = cli_runtime.enable_compile_cache(False)  # a second run loads its programs instead of compiling
    config = flash_slice_config(2 if args.quick else 8, args.quick)  # quick: one KDA and one MLA layer
    args.vocab = config.vocab_size
    dtype = jnp.float32 if args.quick else jnp.bfloat16
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}: {config.num_hidden_layers} layers, hidden "
        f"{config.hidden_size}, {config.num_experts} experts, {jnp.dtype(dtype).name}; prompts "
        f"{args.min_prompt}-{args.max_prompt}, outputs {args.min_output}-{args.max_output} tokens; compilation "
        f"cache {cache_dir or 'off'}",
        flush=True,
    )
    if args.quick:
        model = LingForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype)
    else:  # bf16 experts of 8 full-width layers are 129 GB: kept FP8 (68.7 GB), as a served checkpoint is
        model = random_model(config, weights=STORED, dtype=dtype)
    if args.prefix_tokens:  # first: its own engine, and the figure a time-limited run must not lose
        off, on = run_prefix(model, args)
        print(
            f"shared {args.prefix_tokens}-token prefix, TTFT median: prefix cache off {off * 1e3:.1f} ms, on "
            f"{on * 1e3:.1f} ms ({off / on:.1f}x lower)",
            flush=True,
        )
    max_context = args.max_prompt + args.max_output
    engine = Engine(
        model,
        max_batch=max(levels),
        max_context=max_context,
        prefill_chunk=args.prefill_chunk,
        prefill_budget=args.prefill_budget,
        decode_steps=args.decode_steps,
        plain_greedy_programs=False if args.general_sampling else None,
    )
    start = time.perf_counter()
    engine.warm_up()
    print(f"served: compiled in {time.perf_counter() - start:.0f} s", flush=True)
    tokenizer = load_tokenizer(None, config)
    scheduler = Scheduler(engine, tokenizer, eos_ids=(), max_queue=1 << 20)
    scheduler.start()
    generator = Generator(model, prefill_chunk=args.prefill_chunk)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=1) if args.temperature else GREEDY
    rows = []
    for level in levels:
        requests = workload(args.requests or max(8, 2 * level), args, seed=level)
        run_served(scheduler, requests[: min(len(requests), level)], level, sampling)  # warm-up: no compiles left
        if args.profile and level == levels[-1]:
            with jax.profiler.trace(args.profile, create_perfetto_trace=True):
                served = run_served(scheduler, requests, level, sampling)
        else:
            served = run_served(scheduler, requests, level, sampling)
        static = None
        if not args.skip_static:
            run_static(generator, requests, level, sampling)  # warm-up: compiles every batch's shapes
            static = run_static(generator, requests, level, sampling)
        rows.append((level, len(requests), served, static))
        print(f"concurrency {level}: served {result_line(served)}; static {result_line(static)}", flush=True)
    scheduler.stop()
    print("\n| concurrency | requests | mode | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms |")
    print("|---|---|---|---|---|---|")
    for level, count, served, static in rows:
        for mode, result in (("ling-serve", served), ("static Generator", static)):
            if result is not None:
                print(f"| {level} | {count} | {mode} | {result_cells(result)} |")
    return 0


def result_line(result: dict | None) -> str:
    if result is None:
        return "skipped"
    return (
        f"{result['tokens_per_s']:,.1f} tok/s, TTFT p50 {result['ttft'][0] * 1e3:.1f} ms p99 "
        f"{result['ttft'][1] * 1e3:.1f} ms, TPOT p50 {result['tpot'][0] * 1e3:.2f} ms p99 "
        f"{result['tpot'][1] * 1e3:.2f} ms"
    )


def result_cells(result: dict) -> str:
    ttft, tpot = result["ttft"], result["tpot"]
    return (
        f"{result['tokens_per_s']:,.1f} | {ttft[0] * 1e3:.1f} / {ttft[1] * 1e3:.1f} | "
        f"{tpot[0] * 1e3:.2f} / {tpot[1] * 1e3:.2f}"
    )


if __name__ == "__main__":
    sys.exit(main())
