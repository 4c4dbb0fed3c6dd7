#!/usr/bin/env python3
"""Prefill throughput and decode-step time of a full-width Ling-3.1-flash slice on one GPU, vs the roofline.

    python -m benchmarks.generate            # hidden 4096, one 8-layer group (7 KDA + 1 MLA), all-MoE,
                                                # 512 experts, random bf16 weights; batch 1 and 64, context 8192
    python -m benchmarks.generate --quick    # a narrow 2-layer model (smoke test)

    python -m benchmarks.generate --weights bf16,stored   # also the block-FP8 weights a checkpoint stores
    python -m benchmarks.generate --preset ling-3.0-flash --weights stored --batches 1,8,32
                                                # a whole preset instead of the slice: all its layers, and its
                                                # MTP layer's weights resident (not run: plain decode steps)
    python -m benchmarks.generate --decode-only --kda-decode separate,fused   # the KDA decode step as separate ops
                                                # and as one kernel a layer, on the same weights
    python -m benchmarks.generate --preset ling-3.0-flash --weights stored --batches 1 --decode-only --mtp 1
                                                # also generate.py's speculative round against its decode step
    python -m benchmarks.generate --preset ling-3.0-flash --weights stored --decode-only \
        --variants gemv.min_programs=1056,mla.min_split=64   # launch settings timed in the model, same weights
    python -m benchmarks.generate --preset ling-3.0-flash --weights stored --batches 1 --context 32768 \
        --prefill-tokens 8192 --prefill-only --kda-prefill default,gpu_triton   # the prefill under each KDA kernel
    python -m benchmarks.generate --preset ling-3.0-flash --weights stored --batches 1 --context 32768 \
        --prefill-tokens 8192 --prefill-only --mla-prefill gpu_triton,gpu_mosaic   # and under each MLA kernel
    python -m benchmarks.generate --preset ling-3.0-flash --weights stored --batches 1 --context 32768 \
        --prefill-tokens 8192 --prefill-only --prefill-command-buffers on,off   # with and without command buffers

Weights: "bf16" (every parameter dense) and/or "stored" (block FP8 where a published checkpoint stores it, kept
FP8 on the device), random, initialised straight on the device (`ling_jax.generation.random_init`); each
format's device memory after init is read from `memory_stats`, and the peak after each batch's runs. A model whose
parameters and largest batch's cache cannot fit the device (`ling_jax.generation.fit_check`) is refused with one
line before any weight is initialised.
Prefill: the prompt goes through the cache in chunks (as `Generator` does), timed after a warm-up. Decode:
one jitted, cache-donating step (the model's Pallas KDA / MLA decode kernels and grouped-matmul experts)
over a cache holding `context` tokens, the steps dispatched back to back as `Generator` runs them (mean
per step; `--profile DIR` adds a Perfetto trace of 5 steps, and prints from it the kernels per step and the device
time per layer kind: `benchmarks.trace`; with `--prefill-only`, of one more prefill, per prefill call). Roofline:
the bytes a step must read, i.e. every non-expert weight, the routed experts this step's tokens actually picked
(counted from the routing), the KDA states (read and written) and the MLA latent cache, divided by the device copy
bandwidth measured in the same run. At batch 1 the prefill time of the whole `--context`-token prompt is printed
as the time to first token.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import os
import pathlib
import sys
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import trace, variants  # noqa: E402
from benchmarks.common import (  # noqa: E402
    PROFILE_STEPS,
    copy_bandwidth,
    filled_cache,
    first_layers,
    flash_slice_config,
    time_decode,
    time_speculation,
)
from benchmarks.trace import profile_report  # noqa: E402
from ling_jax import xla_flags  # noqa: E402
from ling_jax.cache import KDAState, LingCache, MLAState  # noqa: E402
from ling_jax.checkpoints.hf import BF16, STORED  # noqa: E402
from ling_jax.generation.cli_checks import device_memory  # noqa: E402
from ling_jax.generation.fit_check import check_fit  # noqa: E402
from ling_jax.generation.flags import positive_int  # noqa: E402
from ling_jax.generation.generator import DECODE_READ_GROUP  # noqa: E402
from ling_jax.generation.random_init import random_model  # noqa: E402
from ling_jax.policy import ExecutionPolicy, FP8Matmul, KDADecode  # noqa: E402
from ling_jax.presets import PRESETS, preset  # noqa: E402
from pallas_kernels.kda import ops as kda_ops  # noqa: E402
from pallas_kernels.mla import ops as mla_ops  # noqa: E402


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def step_bytes(model, cache: LingCache, token_B) -> tuple[int, dict]:
    """Bytes one decode step must read (KDA states also written), from the routing of this very step: whatever
    the weights' format, a routed expert's bytes are its layer's expert stack bytes over the expert count."""
    config = model.config
    graphdef, params = nnx.split(model)

    @jax.jit
    def loads(params, cache, token_B):
        _, captured = nnx.capture(nnx.merge(graphdef, params), nnx.Intermediate)(token_B[:, None], cache=cache)
        return [
            leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(captured)
            if "expert_load" in jax.tree_util.keystr(path)
        ]

    touched = [int((np.asarray(load) > 0).sum()) for load in loads(params, cache, token_B)]
    flat = [
        (".".join(map(str, path)), variable.get_value())
        for path, variable in nnx.to_flat_state(params)
        if path[0] != "mtp"  # resident, never read by a plain decode step
    ]
    all_experts = sum(_nbytes(value) for name, value in flat if ".mlp.experts." in name)
    expert_bytes = all_experts // (config.num_experts * len(touched))
    embedding = sum(_nbytes(value) for name, value in flat if name.endswith("word_embeddings.weight"))
    read = sum(_nbytes(value) for _, value in flat)
    weights = read - all_experts - embedding + sum(touched) * expert_bytes  # only B embedding rows read
    kda = sum(2 * s.recurrent_state.nbytes + 2 * s.conv_window.nbytes for s in cache.layers if isinstance(s, KDAState))
    batch, context = cache.lengths.shape[0], int(cache.lengths[0])
    mla = sum(
        batch * context * s.latent.shape[-1] * s.latent.dtype.itemsize for s in cache.layers if isinstance(s, MLAState)
    )
    parts = {"weights": weights, "kda_states": kda, "mla_cache": mla, "experts_touched_per_layer": touched}
    return weights + kda + mla, parts


COMMAND_BUFFERS_OFF = {"xla_gpu_enable_command_buffer": ""}  # one program's compile option: XLA's command buffers off


def time_prefill(
    model,
    batch: int,
    context: int,
    chunk: int,
    profile_dir: pathlib.Path | None = None,
    compiler_options: dict | None = None,
) -> float:
    """Seconds to prefill `context` tokens a row in `chunk`-token calls, timed after a compiling pass. With
    profile_dir, one more prefill runs under the JAX profiler (a Perfetto trace there) and the chunk's compiled
    HLO text goes to profile_dir/trace.HLO_FILE (`benchmarks.trace.profile_report` reads both). compiler_options:
    the chunk program's XLA options (COMMAND_BUFFERS_OFF: that program without command buffers)."""
    graphdef, params = nnx.split(model)

    # the cache updated in place, as Generator's prefill does
    @functools.partial(jax.jit, donate_argnums=1, compiler_options=compiler_options)
    def prefill(params, cache, ids_BC):  # hidden states only: the lm_head runs on the last position alone
        model = nnx.merge(graphdef, params)
        hidden_BCD, cache = model.model(ids_BC, cache=cache, policy=model.policy)
        return model.logits(hidden_BCD[:, -1:]), cache

    ids = jax.random.randint(jax.random.key(1), (batch, context), 0, model.config.vocab_size)
    elapsed = []
    for _ in range(2):  # the first pass compiles
        cache = model.init_cache(batch, context + 8)
        jax.block_until_ready(cache)
        start = time.perf_counter()
        for offset in range(0, context, chunk):
            _, cache = prefill(params, cache, ids[:, offset : offset + chunk])
        dispatched = time.perf_counter() - start
        jax.block_until_ready(cache)
        elapsed.append(time.perf_counter() - start)
    # the host's share: where the calls return close to the end, the device waited for the host
    print(f"prefill of {context} tokens a row: {elapsed[-1]:.3f} s, the last call returned after {dispatched:.3f} s")
    if profile_dir:
        profile_dir.mkdir(parents=True, exist_ok=True)
        cache = model.init_cache(batch, context + 8)
        hlo_text = prefill.lower(params, cache, ids[:, :chunk]).compile().as_text()
        (profile_dir / trace.HLO_FILE).write_text(hlo_text)
        with jax.profiler.trace(str(profile_dir), create_perfetto_trace=True):
            for offset in range(0, context, chunk):
                _, cache = prefill(params, cache, ids[:, offset : offset + chunk])
            jax.block_until_ready(cache)
    return elapsed[-1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a narrow model and short context")
    parser.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes (default 1,8,64)")
    parser.add_argument("--context", type=positive_int, help="tokens in the cache per row (default 8192; --quick 512)")
    parser.add_argument(
        "--prefill-tokens",
        type=positive_int,
        default=32768,
        help="tokens per prefill call (batch x chunk), like Generator's --prefill-chunk (default 32768)",
    )
    parser.add_argument("--steps", type=positive_int, default=20, help="timed decode steps per batch (default 20)")
    parser.add_argument("--decode-only", action="store_true", help="skip the prefill measurement")
    parser.add_argument(
        "--prefill-only", action="store_true", help="skip the decode steps (the prefill and time to first token only)"
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="write a Perfetto trace of 5 decode steps of the first batch and print, from it, the kernels per step "
        "and the device time per layer kind (KDA, MLA, MoE / dense FFN, lm_head / sampling, other); with --mtp also "
        "one call of generate.py's programs of decode steps and of speculative rounds (DIR/decode_group, "
        "DIR/speculative_group); with --prefill-only instead the first batch's prefill under the first --kda-prefill "
        "and --mla-prefill kernels (DIR/prefill_KDA_MLA), per prefill call (chunk)",
    )
    parser.add_argument(
        "--weights",
        default="bf16,stored",
        help="comma-separated weight formats: bf16 and/or stored (block FP8) (default: both)",
    )
    parser.add_argument(
        "--fp8-matmul",
        default="auto",
        choices=[mode.value for mode in FP8Matmul],
        help="how block-FP8 weights multiply (ExecutionPolicy.fp8_matmul): auto (the default: W8A8 from 256 rows, the "
        "weight-only kernels below), weight_only (the weight-only kernels, dequantise + dot past 255 rows), w8a8",
    )
    parser.add_argument(
        "--kda-decode",
        default="auto",
        help="ExecutionPolicy.kda_decode, comma-separated (auto, separate, fused): the KDA layers' decode step as "
        "separate ops or one fused kernel (auto, the default: fused on a GPU); each is timed on the same weights and "
        "cache contents",
    )
    parser.add_argument(
        "--kda-prefill",
        default="default",
        help="ExecutionPolicy.kda_prefill, comma-separated: default (the platform's chunk_kda kernel) and/or "
        "chunk_kda variant names (gpu_triton_short, ...); the prefill is timed under each on the same weights, the "
        "decode rows carry the first's",
    )
    parser.add_argument(
        "--mla-prefill",
        default="default",
        help="ExecutionPolicy.mla_prefill, comma-separated: default (the op's mla_prefill kernel) and/or mla_prefill "
        "variant names (gpu_mosaic, ...); the prefill is timed under each, after each --kda-prefill",
    )
    parser.add_argument(
        "--prefill-command-buffers",
        default="on",
        help="on and/or off, comma-separated: the prefill program compiled with XLA's command buffers as the process "
        "sets them (ling_jax.xla_flags) or without them (its own compile option), each timed on the same weights",
    )
    parser.add_argument(
        "--variants",
        help="comma-separated launch-setting variants, each TARGET.FIELD=VALUE[:TARGET.FIELD=VALUE...] "
        "(`benchmarks.variants`: gemv.min_programs=1056, mla.min_split=64, ...), each timed on the same weights "
        "and cache contents after the shipped settings (default: those only)",
    )
    parser.add_argument(
        "--mtp",
        type=int,
        default=0,
        metavar="K",
        help="also time generate.py's speculative rounds of K drafts against its decode steps, per batch (a preset "
        "with an MTP layer): the time per round and the break-even acceptance",
    )
    parser.add_argument(
        "--sampling",
        default="general",
        help="with --mtp, how generate.py's programs are traced for their greedy rows, comma-separated, each timed: "
        "general (every optional sampling step behind its lax.cond, one program for any parameters) and/or "
        "specialised (the steps no row uses left out: SamplingArrays.from_params(specialise=True))",
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="a whole preset's model (its MTP layer's weights resident, not run) instead of the slice",
    )
    parser.add_argument(
        "--layers",
        type=positive_int,
        help="with --preset: only its first N decoder layers (a GPU too small for the whole model: the layers' "
        "costs at full width, not the whole model's step)",
    )
    args = parser.parse_args(argv)
    xla_flags.set_gpu_flags()  # as generate.py and ling-serve run (LING_JAX_XLA_FLAGS=0: XLA's own defaults)
    formats = args.weights.split(",")
    if not formats or set(formats) - {BF16, STORED}:
        parser.error(f"--weights: expected bf16 and/or stored, comma-separated, got {args.weights!r}")
    kda_modes = {mode.value for mode in KDADecode}
    if set(args.kda_decode.split(",")) - kda_modes:
        parser.error(f"--kda-decode: expected {', '.join(sorted(kda_modes))}, comma-separated, got {args.kda_decode!r}")
    unknown = set(args.kda_prefill.split(",")) - {"default", *kda_ops.VARIANTS["chunk_kda"]}
    if unknown:
        known = ", ".join(["default", *kda_ops.VARIANTS["chunk_kda"]])
        parser.error(f"--kda-prefill: expected names among {known}, comma-separated, got {args.kda_prefill!r}")
    unknown = set(args.mla_prefill.split(",")) - {"default", *mla_ops.VARIANTS["mla_prefill"]}
    if unknown:
        known = ", ".join(["default", *mla_ops.VARIANTS["mla_prefill"]])
        parser.error(f"--mla-prefill: expected names among {known}, comma-separated, got {args.mla_prefill!r}")
    if not set(args.prefill_command_buffers.split(",")) <= {"on", "off"}:
        parser.error(f"--prefill-command-buffers: expected on and/or off, got {args.prefill_command_buffers!r}")
    if not all(batch.strip().isdigit() and int(batch) > 0 for batch in args.batches.split(",")):
        parser.error(f"--batches: expected positive integers, comma-separated, got {args.batches!r}")
    try:
        for text in args.variants.split(",") if args.variants else ():
            variants.parse(text)
    except ValueError as error:
        parser.error(f"--variants: {error}")
    if args.prefill_only and (args.decode_only or args.mtp or args.variants):
        parser.error("--prefill-only times no decode step: it takes none of --decode-only, --mtp, --variants")
    if args.mtp < 0:
        parser.error(f"--mtp must be >= 0, got {args.mtp}")
    if set(args.sampling.split(",")) - {"general", "specialised"}:
        parser.error(f"--sampling: expected general and/or specialised, comma-separated, got {args.sampling!r}")
    if args.mtp and not args.preset:
        parser.error("--mtp needs --preset (the slice has no MTP layer)")
    if args.layers and not args.preset:
        parser.error("--layers needs --preset (the slice's layers are fixed)")
    if args.preset:
        config = preset(args.preset)
        if args.layers:
            try:
                config = first_layers(config, args.layers)
            except ValueError as error:
                parser.error(str(error))
    else:
        config = flash_slice_config(2 if args.quick else 8, args.quick)  # quick: one KDA and one MLA layer
    context = args.context or (512 if args.quick else 8192)
    refusal = too_big(config, formats, context, max(int(batch) for batch in args.batches.split(",")), args.mtp > 0)
    if refusal:
        parser.error(refusal)
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}: {config.num_hidden_layers} layers "
        f"{config.layer_types}, hidden {config.hidden_size}, {config.num_experts} experts; "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
        flush=True,
    )
    copy = copy_bandwidth(2, nbytes=1 << 20) if args.quick else copy_bandwidth(10)
    print(f"device copy: {copy / 1e12:.2f} TB/s", flush=True)
    rows = []
    for weights in formats:
        rows += bench_format(config, weights, args, context, copy)
    print(
        "\n| weights | KDA decode | device memory GB | batch | context | prefill tok/s | decode step ms | roofline ms "
        "| ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for weights, kda_decode, memory, batch, prefill_tps, decode_s, roofline_s in rows:
        print(
            f"| {weights} | {kda_decode} | {memory} | {batch} | {context} | {prefill_tps:,.0f} | "
            f"{decode_s * 1e3:.2f} | {roofline_s * 1e3:.2f} | {decode_s / roofline_s:.2f}x |"
        )
    return 0


def too_big(config, formats: list[str], context: int, batch: int, mtp: bool) -> str | None:
    """Why the model cannot fit the first device's memory in one of `formats` (its parameters and the largest
    batch's cache: `ling_jax.generation.fit_check`), checked before any weight is initialised; None when it fits
    or the device reports no memory limit (a CPU)."""
    hardware = device_memory()
    if hardware is None:
        return None
    for weights in formats:
        refusal = check_fit(
            config, {}, hardware, weights=weights, batch=batch, context=context, mtp=mtp, skip_flag=None
        )
        if refusal:
            return f"--weights {weights}: the model {refusal}"
    return None


def device_memory_gb(key: str = "bytes_in_use") -> str:
    stats = jax.devices()[0].memory_stats()
    return f"{stats[key] / 1e9:.1f}" if stats else "n/a"


def bench_format(config, weights: str, args, context: int, copy: float) -> list[tuple]:
    """Rows (weights, KDA decode, device memory, batch, prefill tok/s, decode s, roofline s) of one weight format,
    a row per batch and KDA decode mode."""
    start = time.perf_counter()
    kda_modes = args.kda_decode.split(",")
    patch_sets = [{}, *(variants.parse(v) for v in args.variants.split(","))] if args.variants else [{}]
    policy = ExecutionPolicy(fp8_matmul=args.fp8_matmul, kda_decode=kda_modes[0])
    model = random_model(config, weights=weights, dtype=jnp.bfloat16, policy=policy)
    params_gb = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model))) / 1e9
    memory = device_memory_gb()
    print(
        f"{weights}: random init {params_gb:.1f} GB of weights in {time.perf_counter() - start:.0f} s; "
        f"device memory in use {memory} GB",
        flush=True,
    )
    rows = []
    batches = [int(b) for b in args.batches.split(",")]
    first_batch = batches[0]
    for batch in batches:
        chunk = max(64, min(context, args.prefill_tokens // batch))
        prefill = {}
        prefills = itertools.product(
            args.kda_prefill.split(","), args.mla_prefill.split(","), args.prefill_command_buffers.split(",")
        )
        for index, (kda_name, mla_name, buffers) in enumerate(() if args.decode_only else prefills):
            model.policy = dataclasses.replace(
                model.policy,
                kda_prefill=None if kda_name == "default" else kda_name,
                mla_prefill=None if mla_name == "default" else mla_name,
            )
            name = f"KDA prefill {kda_name}, MLA prefill {mla_name}"
            profile = None
            if args.profile and args.prefill_only and batch == first_batch and index == 0:
                profile = pathlib.Path(args.profile) / f"prefill_{kda_name}_{mla_name}"
            options = COMMAND_BUFFERS_OFF if buffers == "off" else None
            prefill[name, buffers] = time_prefill(model, batch, context, chunk, profile, options)
            print(
                f"{weights} batch {batch}, {name}, command buffers {buffers}: "
                f"{batch * context / prefill[name, buffers]:,.0f} tok/s "
                f"(chunk {chunk}; {prefill[name, buffers]:.3f} s for {context} tokens a row)",
                flush=True,
            )
            if profile:
                report = profile_report(profile, -(-context // chunk))
                print(f"{weights} batch {batch}, {name}, a prefill call by layer kind:\n{report}\n")
        model.policy = dataclasses.replace(model.policy, kda_prefill=None, mla_prefill=None)
        prefill_s = next(iter(prefill.values()), math.nan)
        if args.prefill_only:
            rows.append((weights, "-", memory, batch, batch * context / prefill_s, math.nan, math.nan))
            if batch == 1:
                print(f"{weights}: time to first token of a {context}-token prompt {prefill_s:.2f} s", flush=True)
            continue
        token = jax.random.randint(jax.random.key(2), (batch,), 0, config.vocab_size)
        nbytes, parts = step_bytes(model, filled_cache(model, batch, context, args.steps + 16), token)
        roofline_s = nbytes / copy  # copy bandwidth counts every byte moved (read + written)
        for kda_decode, patches in itertools.product(kda_modes, patch_sets):
            model.policy = dataclasses.replace(model.policy, kda_decode=kda_decode)
            variant = kda_decode + variants.apply(patches)
            cache = filled_cache(model, batch, context, args.steps + 16)  # the same contents for every mode
            try:
                decode_s = time_decode(model, cache, args.steps, args.profile if not rows else None)
            except Exception as error:  # a variant that fails to compile or run: the others still run
                if not patches:
                    raise
                print(f"{weights} batch {batch}, KDA decode {variant}: failed: {str(error).splitlines()[0][:300]}")
                continue
            finally:
                del cache
            rows.append((weights, variant, memory, batch, batch * context / prefill_s, decode_s, roofline_s))
            print(
                f"{weights} batch {batch}, KDA decode {variant}: prefill {batch * context / prefill_s:,.0f} tok/s "
                f"(chunk {chunk}); decode step {decode_s * 1e3:.2f} ms; roofline {roofline_s * 1e3:.2f} ms "
                f"({nbytes / 1e9:.2f} GB: weights {parts['weights'] / 1e9:.2f}, KDA {parts['kda_states'] / 1e9:.2f}, "
                f"MLA {parts['mla_cache'] / 1e9:.2f}; experts touched per layer "
                f"{parts['experts_touched_per_layer']}); {decode_s / roofline_s:.2f}x roofline; device memory peak "
                f"so far {device_memory_gb('peak_bytes_in_use')} GB",
                flush=True,
            )
            if args.profile and len(rows) == 1:
                report = profile_report(pathlib.Path(args.profile), PROFILE_STEPS)
                print(f"{weights} batch {batch}, the profiled decode steps by layer kind:\n{report}\n", flush=True)
        variants.apply({})
        for index, sampling in enumerate(args.sampling.split(",") if args.mtp else ()):
            # the first mode's programs of the profiled batch are traced
            profile = args.profile if batch == first_batch and index == 0 else None
            step_s, round_s = time_speculation(
                model, batch, context, args.mtp, profile_dir=profile, specialise=sampling == "specialised"
            )
            print(
                f"{weights} batch {batch}, MTP {args.mtp} draft(s), {sampling} sampling: generate.py's decode step "
                f"{step_s * 1e3:.2f} ms, speculative round {round_s * 1e3:.2f} ms ({round_s / step_s:.2f} steps): it "
                f"pays from {round_s / step_s - 1:.2f} accepted drafts a round "
                f"({(round_s / step_s - 1) / args.mtp:.0%} of {args.mtp})",
                flush=True,
            )
            for name, what in (("decode_group", "decode steps"), ("speculative_group", "speculative rounds")):
                if profile:
                    report = profile_report(pathlib.Path(profile) / name, DECODE_READ_GROUP)
                    print(f"{weights} batch {batch}, generate.py's program of {what}:\n{report}\n", flush=True)
        if batch == 1 and not args.decode_only:
            print(f"{weights}: time to first token of a {context}-token prompt {prefill_s:.2f} s", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
