#!/usr/bin/env python3
"""KDA on one GPU: our kernels vs fla 0.6.0 (Triton) on the same inputs, in one run.

    python -m benchmarks.kda                  # decode B in {1, 64, 256}; prefill B=1 T=32768 and B=8 T=4096
    python -m benchmarks.kda --prefill-only
    python -m benchmarks.kda --prefill-only --prefill-size 1 32768 --iters 20   # one size
    python -m benchmarks.kda --prefill-only --variant gpu_triton --variant gpu_triton_fused   # some variants
    python -m benchmarks.kda --quick          # on a CPU: the prefill variants interpreted, small (wiring only)

Decode: `kda_decode_step` (Pallas GPU, state donated and updated in place) vs fla's `fused_recurrent_kda`
with T=1; the state traffic is 2 x 4 B x B x H x K x V per step. Prefill: the chunk_kda variants (Pallas, two
phases: gpu_triton, phase 1 in three pallas_calls; the lab's gpu_triton_fused and gpu_triton_fused_wy, phase 1 in
one and two, from `pallas_kernels.experimental.kda_fused`) vs fla's `chunk_kda` (and,
with --jnp-baseline, the jnp chunked form under XLA: ~180 ms a call at T=32768), over a few tile variants of the
fused kernel and the any-gate variants (for gates below -5, on the same gates); each variant also times its two
phases alone (phase 1: intra-chunk, parallel, and each of its kernels; phase 2: the
sequential state pass), with the bytes each must move at least; the fastest (safe-gate) variant is named. Each
kernel is checked against fla on the device before it is timed. H=64, K=V=128.
fla must be importable (carry its wheel: pip install --no-deps fla_core-0.6.0-py3-none-any.whl).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time

# fla (torch) runs beside jax on the same GPU: jax takes memory as it needs it rather than a preallocated fraction
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import copy_bandwidth, median_seconds, rel_error  # noqa: E402
from pallas_kernels.experimental import kda_fused  # noqa: E402
from pallas_kernels.kda import (
    kda_chunked,  # noqa: E402
    tuned,  # noqa: E402
)
from pallas_kernels.kda.gpu_triton import (  # noqa: E402
    decay_blocks,
    inter_chunk,
    intra_chunk,
    intra_chunk_any_gate,
    sub_block_keys,
    wy_factors,
)
from pallas_kernels.kda.ops import kernel  # noqa: E402
from pallas_kernels.tuning import lookup  # noqa: E402

kda_decode_step_gpu = kernel("kda_decode_step", "gpu_triton")

HEADS, DIM = 64, 128
CPU_HEADS = 2  # the interpreted smoke run's


def torch_median_seconds(fn, iters: int) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=max(iters, 25) * 4, return_mode="median") / 1e3


def torch_copy_bandwidth(iters: int, nbytes: int = 4 << 30) -> float:
    """Bytes per second (read + written) of a device-to-device copy of `nbytes` by torch, timed like fla's
    kernels (triton's do_bench, best of its samples): the copy figure the issue quotes (4.27 TB/s)."""
    import torch
    import triton.testing

    x = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").normal_()
    y = torch.empty_like(x)
    seconds = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=max(iters, 25) * 4, return_mode="min") / 1e3
    return 2 * nbytes / seconds


def random_inputs(batch, length, seed, heads=HEADS):
    r = np.random.default_rng(seed)
    q = r.normal(size=(batch, length, heads, DIM)).astype(np.float32)
    k = r.normal(size=(batch, length, heads, DIM)).astype(np.float32)
    v = r.normal(size=(batch, length, heads, DIM)).astype(np.float32)
    g = (-5.0 * r.uniform(size=(batch, length, heads, DIM)) ** 4).astype(np.float32)  # mostly slow decay
    beta = r.uniform(0.05, 1.0, size=(batch, length, heads)).astype(np.float32)
    return q, k, v, g, beta


def to_torch(*arrays, dtype=None):
    import torch

    return [torch.from_numpy(np.ascontiguousarray(a)).cuda().to(dtype or torch.float32) for a in arrays]


DECODE_TILES = [tuned.DecodeGpuTiles(64, 4), tuned.DecodeGpuTiles(64, 2), tuned.DecodeGpuTiles(32, 4)]
DECODE_VARIANTS = {  # kda_decode_step_gpu tiles (`tuned.DECODE_GPU` is the default) for B < 64 and for B >= 64
    "small": DECODE_TILES + [tuned.DecodeGpuTiles(16, 2)],
    "large": DECODE_TILES,
}
STEPS_PER_CALL = 50  # decode steps chained in one jitted program, so host dispatch is not what gets timed


def bench_decode(batch, iters, copy_bytes_per_s):
    import torch
    from fla.ops.kda import fused_recurrent_kda

    q, k, v, g, beta = random_inputs(batch, 1, seed=batch)
    state = np.random.default_rng(1).normal(size=(batch, HEADS, DIM, DIM)).astype(np.float32)
    jq, jk, jv = (jnp.asarray(x[:, 0], jnp.bfloat16) for x in (q, k, v))
    jg, jbeta = jnp.asarray(g[:, 0]), jnp.asarray(beta[:, 0])
    tq, tk, tv = to_torch(q, k, v, dtype=torch.bfloat16)
    tg, tbeta, tstate = to_torch(g, beta, state)
    fla_o, fla_state = fused_recurrent_kda(
        tq, tk, tv, tg, tbeta, initial_state=tstate.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    fla_s = torch_median_seconds(
        lambda: fused_recurrent_kda(
            tq, tk, tv, tg, tbeta, initial_state=tstate, output_final_state=True, use_qk_l2norm_in_kernel=True
        ),
        iters,
    )
    traffic = 2 * 4 * batch * HEADS * DIM * DIM
    best = None
    for tiles in DECODE_VARIANTS["small" if batch < 64 else "large"]:
        step = functools.partial(kda_decode_step_gpu, scale=DIM**-0.5, tiles=tiles)
        o, new_state = jax.jit(step)(jq, jk, jv, jg, jbeta, jnp.asarray(state))
        err_o = rel_error(o, fla_o[:, 0].float().cpu().numpy())
        err_s = rel_error(new_state, fla_state.float().cpu().numpy())

        @functools.partial(jax.jit, donate_argnums=0)
        def steps(s, step=step):  # unrolled: an XLA while loop adds a host round trip per iteration on a GPU
            for _ in range(STEPS_PER_CALL):
                s = step(jq, jk, jv, jg, jbeta, s)[1]
            return s

        carried = jnp.asarray(state)
        samples = []
        for i in range(iters + 2):  # the state is donated: feed each call's output to the next
            start = time.perf_counter()
            carried = jax.block_until_ready(steps(carried))
            samples.append(time.perf_counter() - start)
        ours_s = statistics.median(samples[2:]) / STEPS_PER_CALL
        label = " ".join(f"{name}={value}" for name, value in dataclasses.asdict(tiles).items())
        print(
            f"decode B={batch} {label}: ours {ours_s * 1e6:.1f} us "
            f"({traffic / ours_s / 1e12:.2f} TB/s), fla {fla_s * 1e6:.1f} us ({traffic / fla_s / 1e12:.2f} TB/s);"
            f" vs fla: o {err_o:.1e}, state {err_s:.1e}"
        )
        if best is None or ours_s < best[0]:
            best = (ours_s, err_o)
    ours_s, err_o = best
    return ("decode", batch, 1, ours_s, fla_s, traffic / ours_s / copy_bytes_per_s, err_o)


# the tuned tables' settings on this device (`pallas_kernels/kda/tuned.py`, `experimental.kda_fused`)
PHASE2_DEFAULT = lookup(tuned.CHUNK_INTER, dtype=jnp.bfloat16)
PHASE1 = {  # variant of chunk_kda: (its phase 1, that phase 1's default tiles)
    "gpu_triton": (intra_chunk, lookup(tuned.CHUNK_INTRA, dtype=jnp.bfloat16)),
    "gpu_triton_fused": (kda_fused.fused_intra_chunk, lookup(kda_fused.CHUNK_FUSED, dtype=jnp.bfloat16)),
    "gpu_triton_fused_wy": (kda_fused.fused_wy_intra_chunk, lookup(kda_fused.CHUNK_FUSED_WY, dtype=jnp.bfloat16)),
    "gpu_triton_any_gate": (intra_chunk_any_gate, lookup(tuned.CHUNK_INTRA, dtype=jnp.bfloat16)),
}
PREFILL_VARIANTS = [  # (variant of chunk_kda, phase 1's tiles replaced over its defaults): the default, then the lab's
    ("gpu_triton", {}),
    ("gpu_triton_fused", {}),
    ("gpu_triton_fused", {"num_warps": 8}),
    ("gpu_triton_fused_wy", {}),
    ("gpu_triton_any_gate", {}),  # for gates below -5, on the same safe gates
]


def phase1_kernels(name, q, k, v, g, beta, tiles, interpret):
    """Phase 1's pallas_calls as jitted functions of their own inputs (each timed alone), with the inputs each
    needs: [(name, fn, args)], in order: the keys, block-row and WY-factors kernels of gpu_triton*, the chunk-wide
    products and WY-factors kernels of gpu_triton_fused_wy (none for gpu_triton_fused: one kernel)."""
    if name == "gpu_triton_fused":
        return []  # one kernel: phase 1 itself
    if name == "gpu_triton_fused_wy":
        factors_tiles = dataclasses.replace(
            lookup(tuned.CHUNK_INTRA, dtype=v.dtype), factors_num_warps=tiles.factors_num_warps
        )
        factors_fn = jax.jit(
            functools.partial(
                wy_factors,
                parts_dtype=v.dtype,
                input_dtype=v.dtype,
                tiles=factors_tiles,
                invert_diagonal=True,
                interpret=interpret,
            )
        )
        products_fn = jax.jit(
            functools.partial(
                kda_fused.chunk_blocks,
                scale=DIM**-0.5,
                use_qk_l2norm=True,
                parts_dtype=v.dtype,
                tiles=tiles,
                interpret=interpret,
            )
        )
        _, _, blocks, kb, _, _ = products_fn(q, k, g, beta)
        return [("chunk products", products_fn, (q, k, g, beta)), ("wy factors", factors_fn, (blocks, kb, v, beta))]
    options = dict(
        use_qk_l2norm=True,
        parts_dtype=v.dtype,
        tiles=tiles,
        any_gate=name == "gpu_triton_any_gate",
        interpret=interpret,
    )
    keys_fn = jax.jit(functools.partial(sub_block_keys, **options))
    right, totals = keys_fn(k, g)
    blocks_fn = jax.jit(functools.partial(decay_blocks, scale=DIM**-0.5, **options))
    _, _, blocks, kb, _, _ = blocks_fn(q, k, g, beta, right, totals)
    factors_fn = jax.jit(
        functools.partial(wy_factors, parts_dtype=v.dtype, input_dtype=v.dtype, tiles=tiles, interpret=interpret)
    )
    return [
        ("keys", keys_fn, (k, g)),
        ("blocks", blocks_fn, (q, k, g, beta, right, totals)),
        ("wy factors", factors_fn, (blocks, kb, v, beta)),
    ]


def bench_prefill_phases(inputs, name, tiles: tuned.ChunkTiles, iters, phase1_seconds, interpret):
    """(phase 1 s, its kernels' s, phase 2 s, bytes each phase moves at least), each pallas_call jitted and
    timed alone; phase 1's times are kept per its function and tiles in phase1_seconds."""
    jq, jk, jv, jg, jbeta = inputs
    phase1_args = (jq, jk, jv, jg, jbeta[..., None])
    phase1, _ = PHASE1[name]
    intra = jax.jit(functools.partial(phase1, scale=DIM**-0.5, tiles=tiles.intra, interpret=interpret))
    parts = intra(*phase1_args)
    key = (phase1, tiles.intra)
    if key not in phase1_seconds:
        stages = phase1_kernels(name, *phase1_args, tiles.intra, interpret)
        phase1_seconds[key] = (
            median_seconds(intra, *phase1_args, iters=iters),
            {stage: median_seconds(fn, *args, iters=iters) for stage, fn, args in stages},
        )
    batch, _, heads, _ = jq.shape
    state = jnp.zeros((batch, heads, DIM, DIM), jnp.float32)
    inter = jax.jit(functools.partial(inter_chunk, out_dtype=jv.dtype, tiles=tiles.inter, interpret=interpret))
    inter_s = median_seconds(inter, parts, state, iters=iters)
    parts_bytes = sum(x.nbytes for x in parts)
    phase1_bytes = sum(x.nbytes for x in phase1_args) + parts_bytes
    phase2_bytes = parts_bytes + jv.nbytes + 2 * state.nbytes
    return *phase1_seconds[key], inter_s, phase1_bytes, phase2_bytes


def fla_prefill(q, k, v, g, beta, iters):
    """(o, final state, seconds) of fla's chunk_kda on the GPU."""
    import torch
    from fla.ops.kda import chunk_kda

    tq, tk, tv = to_torch(q, k, v, dtype=torch.bfloat16)
    tg, tbeta = to_torch(g, beta)
    fla_o, fla_state = chunk_kda(tq, tk, tv, tg, tbeta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    fla_s = torch_median_seconds(
        lambda: chunk_kda(tq, tk, tv, tg, tbeta, output_final_state=True, use_qk_l2norm_in_kernel=True), iters
    )
    return fla_o.float().cpu().numpy(), fla_state.float().cpu().numpy(), fla_s


def bench_prefill(batch, length, iters, jnp_baseline: bool, interpret: bool = False, heads: int = HEADS, names=None):
    """Every PREFILL_VARIANTS entry (of the variants `names`, None: all) vs fla (on the GPU) or, interpreted on
    the CPU, vs the jnp chunked form (a smoke run of the wiring: its times say nothing)."""
    q, k, v, g, beta = random_inputs(batch, length, seed=length, heads=heads)
    jq, jk, jv = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    jg, jbeta = jnp.asarray(g), jnp.asarray(beta)
    tokens = batch * length
    if interpret:
        ref_o, ref_state = (np.asarray(x, np.float32) for x in jax.jit(kda_chunked)(jq, jk, jv, jg, jbeta))
        ref_s, ref_name = float("nan"), "jnp chunked"
    else:
        ref_o, ref_state, ref_s = fla_prefill(q, k, v, g, beta, iters)
        ref_name = "fla"
    baseline = ""
    if jnp_baseline:
        jnp_s = median_seconds(jax.jit(kda_chunked), jq, jk, jv, jg, jbeta, iters=iters)
        baseline = f", jnp chunked (XLA) {jnp_s * 1e3:.2f} ms"
    print(
        f"prefill B={batch} T={length}: {ref_name} {ref_s * 1e3:.2f} ms ({tokens / ref_s / 1e6:.2f} Mtok/s){baseline}"
    )
    results, phase1_seconds = [], {}
    for name, overrides in [(name, overrides) for name, overrides in PREFILL_VARIANTS if name in (names or [name])]:
        tiles = tuned.ChunkTiles(intra=dataclasses.replace(PHASE1[name][1], **overrides), inter=PHASE2_DEFAULT)
        fn = jax.jit(functools.partial(kernel("chunk_kda", name), scale=DIM**-0.5, tiles=tiles, interpret=interpret))
        label = " ".join([name] + [f"intra_{key}={value}" for key, value in overrides.items()])
        try:
            o, state = fn(jq, jk, jv, jg, jbeta)
            err_o, err_s = rel_error(o.astype(jnp.float32), ref_o), rel_error(state, ref_state)
            seconds = median_seconds(fn, jq, jk, jv, jg, jbeta, iters=iters)
            intra_s, kernel_s, inter_s, intra_bytes, inter_bytes = bench_prefill_phases(
                (jq, jk, jv, jg, jbeta), name, tiles, iters, phase1_seconds, interpret
            )
        except Exception as error:  # a variant that fails to compile or run must not end the sweep
            print(f"  Pallas {label}: failed: {type(error).__name__}: {str(error)[:300]}")
            continue
        kernels = " + ".join(f"{stage} {s * 1e3:.2f}" for stage, s in kernel_s.items())
        kernels = f"{kernels} alone" if kernels else "one kernel"
        print(
            f"  Pallas {label}: {seconds * 1e3:.2f} ms ({tokens / seconds / 1e6:.2f} Mtok/s, "
            f"{ref_name} / ours {ref_s / seconds:.2f}x); vs {ref_name}: o {err_o:.1e}, state {err_s:.1e}\n"
            f"    phase 1 (intra-chunk) {intra_s * 1e3:.2f} ms ({kernels}), >= {intra_bytes / 1e9:.2f} GB "
            f"({intra_bytes / intra_s / 1e12:.2f} TB/s); phase 2 (state pass) {inter_s * 1e3:.2f} ms, "
            f">= {inter_bytes / 1e9:.2f} GB ({inter_bytes / inter_s / 1e12:.2f} TB/s)"
        )
        results.append((name.endswith("_any_gate"), seconds, err_o, label))
    if not results:
        raise SystemExit(f"prefill B={batch} T={length}: no variant ran")
    _, seconds, err, label = min(results)  # a safe-gate variant when one ran
    print(f"  fastest: {label}")
    return ("prefill", batch, length, seconds, ref_s, None, err)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--decode-only", action="store_true")
    parser.add_argument("--prefill-only", action="store_true")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument(
        "--prefill-size",
        type=int,
        nargs=2,
        action="append",
        metavar=("B", "T"),
        help="prefill batch and length to time (repeatable; default 1 32768 and 8 4096, --quick 1 4096)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        choices=sorted({name for name, _ in PREFILL_VARIANTS}),
        help="prefill: time only this chunk_kda variant's rows (repeatable; default all)",
    )
    parser.add_argument(
        "--jnp-baseline",
        action="store_true",
        help="also time the jnp chunked prefill under XLA (slow: ~180 ms a call at T=32768)",
    )
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        if not args.quick or args.decode_only:
            parser.error(
                f"needs a GPU (jax.default_backend() is {jax.default_backend()!r}); without one, "
                "--quick runs the prefill variants interpreted at a small size (a check of the wiring)"
            )
        print(f"jax {jax.__version__}; no GPU: prefill variants in interpret mode, H={CPU_HEADS} (times meaningless)")
        rows = [bench_prefill(1, 3 * 64, 1, False, interpret=True, heads=CPU_HEADS, names=args.variant)]
    else:
        copy = max(copy_bandwidth(args.iters), 0.0 if args.prefill_only else torch_copy_bandwidth(args.iters))
        print(
            f"jax {jax.__version__}; device copy {copy / 1e12:.2f} TB/s (read + write; the faster of an XLA "
            "elementwise op and a torch copy)"
        )
        decode_batches = () if args.prefill_only else ((1, 64) if args.quick else (1, 64, 256))
        rows = [bench_decode(b, args.iters, copy) for b in decode_batches]
        sizes = args.prefill_size or (((1, 4096),) if args.quick else ((1, 32768), (8, 4096)))
        for batch, length in () if args.decode_only else sizes:
            rows.append(bench_prefill(batch, length, max(5, args.iters // 10), args.jnp_baseline, names=args.variant))
    print(
        "\n| op | B | T | ours | fla | fla / ours | % of copy bandwidth | rel. err vs fla |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for op, batch, length, ours_s, fla_s, frac, err in rows:
        unit, scale = ("us", 1e6) if op == "decode" else ("ms", 1e3)
        share = "" if frac is None else f"{100 * frac:.0f}%"
        print(
            f"| {op} | {batch} | {length} | {ours_s * scale:.1f} {unit} | {fla_s * scale:.1f} {unit} | "
            f"{fla_s / ours_s:.2f}x | {share} | {err:.1e} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
