#!/usr/bin/env python3
"""The real `ling-serve` over HTTP, driven by a streaming client, against the bare decode step at the same batch:
output tokens/s, TTFT and TPOT p50 / p99 per concurrency.

    python -m benchmarks.serve_http --preset ling-3.0-flash --max-batch 32 --concurrency 1,8,32
                                          # full size, random FP8 weights as the checkpoint stores them
    python -m benchmarks.serve_http --quick   # the tiny preset, a few short requests (CPU smoke test)
    python -m benchmarks.serve_http --preset ling-3.0-flash --max-batch 8 --concurrency 1,8 --mtp 2
                                          # the served MTP round: random drafts are rarely accepted, so its
                                          # TPOT is about one round's time (one or two tokens a round)

Served: `ling-serve --preset NAME` started as a subprocess on 127.0.0.1 (random weights in the stored format,
initialised on the device; its time to ready is printed, then the wait until the programs it compiles in the
background after ready are done: steady state is timed), then `concurrency` closed-loop clients (httpx, async),
each streaming /v1/completions and sending its next request when the previous one ends. Requests (seeded, as
`benchmarks.serve` draws them): prompts of random token ids, lengths log-uniform in [--min-prompt, --max-prompt],
max_tokens log-uniform in [--min-output, --max-output], greedy. TTFT: from sending to the first streamed chunk;
TPOT: the rest of the request's time over its further tokens (usage counts them); output tok/s: completion
tokens over the level's wall time; with it, the level's prefill steps a request and their chunks' tokens (pads
included) over the prompts' own, from the server's counters. One request runs first, untimed.
Static: once the server has exited (its device memory freed), the same preset's random weights in this process
and the model's jitted decode step at batch C over a cache of --static-context tokens (`benchmarks.common`
`time_decode`, as `benchmarks.generate` times it): its step is the TPOT a static batch of C gets, C / step its
output tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import filled_cache, time_decode
from benchmarks.serve import percentiles, result_cells, result_line, workload
from ling_jax.generation.random_init import random_model
from ling_jax.presets import preset

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 3600  # full size: random init and every program's compilation, cold
REQUEST_TIMEOUT_S = 600


def start_server(args, max_context: int) -> tuple[subprocess.Popen, str, float]:
    """`ling-serve --preset` on a free port of 127.0.0.1: (process, URL, seconds to `ready`). Its phase lines are
    echoed on stderr."""
    command = [sys.executable, "-m", "ling_jax.serving", "--preset", args.preset, "--port", "0", "--weights"]
    command += [args.weights, "--max-batch", str(args.max_batch), "--max-context", str(max_context)]
    command += ["--prefill-chunk", str(args.prefill_chunk), "--prefill-budget", str(args.prefill_budget)]
    command += ["--max-queue", str(1 << 16)]
    if args.decode_steps is not None:
        command += ["--decode-steps", str(args.decode_steps)]
    if args.mtp:
        command += ["--mtp", str(args.mtp)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True)
    url = None
    for line in process.stderr:
        print(f"  {line.rstrip()}", file=sys.stderr, flush=True)
        if line.startswith("ling-serve: listening on "):
            url = line.split()[3]
        if line.startswith("ling-serve: ready"):
            threading.Thread(target=_drain, args=(process,), daemon=True).start()
            return process, url, time.perf_counter() - start
        if time.perf_counter() - start > READY_TIMEOUT_S:
            break
    process.kill()
    raise RuntimeError(f"ling-serve did not get ready (exit status {process.wait()})")


def wait_compiled(url: str) -> float:
    """Seconds until the server's background compilation is done (its `ling_serve_background_programs` gauge at 0)."""
    start = time.perf_counter()
    while time.perf_counter() - start < READY_TIMEOUT_S:
        found = re.search(r"^ling_serve_background_programs (\S+)$", httpx.get(url + "/metrics").text, re.MULTILINE)
        if found is None or float(found.group(1)) == 0:
            return time.perf_counter() - start
        time.sleep(1.0)
    raise RuntimeError(f"ling-serve still compiled in the background {READY_TIMEOUT_S} s after ready")


PREFILL_COUNTERS = ("prefill_steps", "prefill_tokens", "prompt_tokens")


def prefill_counters(url: str) -> dict[str, float]:
    """The server's prefill counters (`ling_serve_<name>_total`) now."""
    text = httpx.get(url + "/metrics").text
    return {
        name: float(re.search(rf"^ling_serve_{name}_total (\S+)$", text, re.MULTILINE).group(1))
        for name in PREFILL_COUNTERS
    }


def prefill_line(before: dict[str, float], after: dict[str, float], requests: int) -> str:
    """What a level's prompts cost in prefill steps: steps a request, and the chunks' tokens (pads included) over
    the prompts' own."""
    ran = {name: after[name] - before[name] for name in PREFILL_COUNTERS}
    return (
        f"prefill {ran['prefill_steps']:.0f} steps ({ran['prefill_steps'] / requests:.2f} a request), chunk tokens "
        f"{ran['prefill_tokens'] / max(ran['prompt_tokens'], 1):.2f}x the prompts'"
    )


def _drain(process: subprocess.Popen) -> None:
    for line in process.stderr:
        print(f"  {line.rstrip()}", file=sys.stderr, flush=True)


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> tuple:
    """(TTFT s, TPOT s or None, completion tokens) of one streamed completion."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk["choices"]:
                last = time.perf_counter()
                first = first or last
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return first - sent, tpot, tokens


async def closed_loop(url: str, model: str, requests, concurrency: int) -> dict:
    """`concurrency` clients, each sending its next request when its previous one ends."""
    pending = list(reversed(requests))
    ttft, tpot, tokens = [], [], [0]
    limits = httpx.Limits(max_connections=concurrency + 1)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def worker() -> None:
            while pending:
                prompt, max_tokens = pending.pop()
                first, per_token, count = await one_request(client, model, prompt, max_tokens)
                ttft.append(first)
                tpot.extend([per_token] if per_token is not None else [])
                tokens[0] += count

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
        wall = time.perf_counter() - start
    return {"tokens_per_s": tokens[0] / wall, "ttft": percentiles(ttft), "tpot": percentiles(tpot), "wall": wall}


def static_steps(args, levels: list[int], context: int) -> dict[int, float]:
    """Seconds per decode step of the preset's random model at each batch, over a cache of `context` tokens."""
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16  # ling-serve's default --dtype
    model = random_model(preset(args.preset), weights=args.weights, dtype=dtype)
    caches = {level: filled_cache(model, level, context, args.steps + 16) for level in levels}
    return {level: time_decode(model, cache, args.steps) for level, cache in caches.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny preset, a few short requests (CPU)")
    parser.add_argument("--preset", default="ling-3.0-flash", help="the served preset (default ling-3.0-flash)")
    parser.add_argument("--weights", default="stored", choices=("stored", "bf16"), help="ling-serve's --weights")
    parser.add_argument("--concurrency", help="comma-separated client counts (default 1,8,32; --quick 1,2)")
    parser.add_argument("--max-batch", type=int, help="ling-serve's --max-batch (default: the largest concurrency)")
    parser.add_argument("--requests", type=int, default=0, help="requests per concurrency (default 2x it, >= 8)")
    parser.add_argument("--min-prompt", type=int, default=128)
    parser.add_argument("--max-prompt", type=int, default=2048)
    parser.add_argument("--min-output", type=int, default=64)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--prefill-chunk", type=int, default=512, help="ling-serve's --prefill-chunk")
    parser.add_argument("--prefill-budget", type=int, default=1024, help="ling-serve's --prefill-budget")
    parser.add_argument("--decode-steps", type=int, help="ling-serve's --decode-steps (default: its own)")
    parser.add_argument(
        "--mtp", type=int, default=0, help="ling-serve's --mtp K (default 0: off; random weights accept few drafts)"
    )
    parser.add_argument("--steps", type=int, default=20, help="static: timed decode steps per batch")
    parser.add_argument(
        "--no-static",
        action="store_true",
        help="skip the static baseline (a second random init at full size: `benchmarks.generate` times the same steps)",
    )
    parser.add_argument(
        "--static-context",
        type=int,
        help="static: the cache's tokens (default: the requests' mean prompt + half their mean output)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.concurrency = "tiny", args.concurrency or "1,2"
        args.min_prompt, args.max_prompt, args.min_output, args.max_output = 8, 40, 2, 12
        args.prefill_chunk, args.prefill_budget, args.steps, args.requests = 16, 32, 2, args.requests or 3
    levels = [int(c) for c in (args.concurrency or "1,8,32").split(",")]
    args.max_batch = args.max_batch or max(levels)
    args.vocab = preset(args.preset).vocab_size
    loads = {level: workload(args.requests or max(8, 2 * level), args, seed=level) for level in levels}
    every = [request for requests in loads.values() for request in requests]
    context = args.static_context or round(np.mean([len(p) + o / 2 for p, o in every]))
    print(
        f"ling-serve --preset {args.preset} --weights {args.weights} --max-batch {args.max_batch} --mtp {args.mtp}; "
        f"prompts {args.min_prompt}-{args.max_prompt}, outputs {args.min_output}-{args.max_output} tokens; "
        f"static cache {context} tokens",
        flush=True,
    )
    # the server first: this process touches no device until it is gone (the server gets all device memory)
    process, url, ready_s = start_server(args, args.max_prompt + args.max_output)
    print(f"ling-serve ready in {ready_s:.1f} s", flush=True)
    served = {}
    try:
        print(f"every program compiled {wait_compiled(url):.1f} s after ready", flush=True)
        asyncio.run(closed_loop(url, args.preset, every[:1], 1))  # untimed: the first request's host-side setup
        for level in levels:
            before = prefill_counters(url)
            served[level] = asyncio.run(closed_loop(url, args.preset, loads[level], level))
            prefill = prefill_line(before, prefill_counters(url), len(loads[level]))
            print(f"concurrency {level}: served {result_line(served[level])}; {prefill}", flush=True)
    finally:
        process.terminate()
        process.wait(timeout=120)
    steps = {} if args.no_static else static_steps(args, levels, context)
    print(
        "\n| concurrency | requests | served output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | static step ms "
        "| static tok/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for level in levels:
        step = steps.get(level)
        static = "- | -" if step is None else f"{step * 1e3:.2f} | {level / step:,.1f}"
        print(f"| {level} | {len(loads[level])} | {result_cells(served[level])} | {static} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
