#!/usr/bin/env python3
"""KDA on one GPU: our kernels vs fla 0.6.0 (Triton) on the same inputs, in one run.

    python -m benchmarks.kda                  # decode B in {1, 64, 256}; prefill B=1 T=32768 and B=8 T=4096
    python -m benchmarks.kda --prefill-only
    python -m benchmarks.kda --prefill-only --prefill-size 1 32768 --iters 20   # one size
    python -m benchmarks.kda --prefill-only --variant gpu_triton --variant gpu_triton_fused   # some variants
    python -m benchmarks.kda --prefill-only --no-fla --default-tiles   # our variants against each other only
    python -m benchmarks.kda --quick          # on a CPU: the prefill variants interpreted, small (wiring only)
    python -m benchmarks.kda --decode-fused   # a KDA layer's decode step, separate ops vs one fused kernel
    python -m benchmarks.kda --decode-fused --quick   # on a CPU: interpreted, a tiny layer (wiring only)
    python -m benchmarks.kda --segmented --prefill-size 1 32768 --heads 8 --heads 64   # split over segments
    python -m benchmarks.kda --segmented --quick      # on a CPU: interpreted, small (wiring only)

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

--decode-fused (no fla needed): one KDA layer of a preset (--preset, default ling-3.0-flash: H=32, K=V=128,
hidden 2560, bf16 weights) stepping one token per sequence, B in {1, 8, 32, 64, 256}, under
`ExecutionPolicy(kda_decode="separate")` (the convs, gates and norm as XLA ops around `kda_decode_step`) and
`kda_decode="fused"` (`kda_decode_fused`: one kernel between the projections); then the fused kernel alone over
a few tiles (`tuned.DECODE_FUSED_GPU` first) beside the recurrence kernel alone, against the state traffic.
Layer outputs and states of the two are compared on the device first.

--segmented: the safe-gate prefill of one long sequence split over segments (`chunk_kda(segments=n)`,
`pallas_kernels.kda.segments`) against the same kernel unsplit and fla, same inputs, same run, per size and per
--heads (default 8, one GPU's share of H=64 under tensor=8, and 64): unsplit, the segment count of
`segments.segment_count`'s rule, and each count of SEGMENT_SWEEP, each checked against fla first.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import pathlib
import statistics
import sys
import time

# fla (torch) runs beside jax on the same GPU: jax takes memory as it needs it rather than a preallocated fraction
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import trace  # noqa: E402
from benchmarks.common import copy_bandwidth, median_seconds, per_call_seconds, rel_error  # noqa: E402
from ling_jax import ExecutionPolicy, KDAState  # noqa: E402
from ling_jax.kda import KimiDeltaAttention  # noqa: E402
from ling_jax.presets import preset  # noqa: E402
from pallas_kernels.backend import device_cores  # noqa: E402
from pallas_kernels.experimental import kda_fused  # noqa: E402
from pallas_kernels.kda import (  # noqa: E402
    DecodeWeights,
    kda_chunked,
    tuned,
)
from pallas_kernels.kda.gpu_triton import (  # noqa: E402
    decay_blocks,
    inter_chunk,
    intra_chunk,
    intra_chunk_any_gate,
    sub_block_keys,
    wy_factors,
)
from pallas_kernels.kda.gpu_triton.short_chunks import short_chunk_parts  # noqa: E402
from pallas_kernels.kda.ops import chunk_kda, kernel  # noqa: E402
from pallas_kernels.kda.segments import segment_count  # noqa: E402
from pallas_kernels.tuning import lookup  # noqa: E402

kda_decode_step_gpu = kernel("kda_decode_step", "gpu_triton")
kda_decode_fused_gpu = kernel("kda_decode_fused", "gpu_triton")

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
PROFILED_CALLS = 3  # calls of a --segmented row under the profiler
CHAINED = 4  # calls in one program for a --segmented row's chained time


def seconds_per_step(advance, carried, *rest, iters: int, steps_per_call: int = STEPS_PER_CALL) -> float:
    """Median seconds of one `advance(carried, *rest) -> carried`, steps_per_call of them unrolled in one jitted
    program (an XLA while loop adds a host round trip per iteration on a GPU) whose carried input is donated, each
    call fed the last one's output, after two warm-up calls."""

    @functools.partial(jax.jit, donate_argnums=0)
    def steps(carried, *rest):
        for _ in range(steps_per_call):
            carried = advance(carried, *rest)
        return carried

    samples = []
    for _ in range(iters + 2):
        start = time.perf_counter()
        carried = jax.block_until_ready(steps(carried, *rest))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[2:]) / steps_per_call


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

        ours_s = seconds_per_step(
            lambda s, step=step: step(jq, jk, jv, jg, jbeta, s)[1], jnp.asarray(state), iters=iters
        )
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


FUSED_DECODE_BATCHES = {"full": (1, 8, 32, 64, 256), "quick": (1, 64), "cpu": (3,)}
FUSED_DECODE_TILES = [  # kda_decode_fused_gpu tiles: the table's first (`tuned.DECODE_FUSED_GPU`)
    lookup(tuned.DECODE_FUSED_GPU, dtype=jnp.bfloat16),
    tuned.DecodeFusedGpuTiles(32, 4),
    tuned.DecodeFusedGpuTiles(64, 8),
    tuned.DecodeFusedGpuTiles(128, 8),
    tuned.DecodeFusedGpuTiles(32, 2),
    tuned.DecodeFusedGpuTiles(64, 4, value_splits=1),  # one program a head, the norm in the kernel at any batch
    tuned.DecodeFusedGpuTiles(32, 4, value_splits=2),
    tuned.DecodeFusedGpuTiles(32, 4, value_splits=4),
    tuned.DecodeFusedGpuTiles(16, 2, value_splits=8),
]


def random_kda_state(config, batch, seed) -> KDAState:
    """A conv window and recurrent state of random values, as a prefill leaves them (bf16 window)."""
    r = np.random.default_rng(seed)
    zeros = KDAState.zeros(config, batch, jnp.bfloat16)
    return KDAState(
        conv_window=jnp.asarray(r.normal(size=zeros.conv_window.shape), jnp.bfloat16),
        recurrent_state=jnp.asarray(0.1 * r.normal(size=zeros.recurrent_state.shape), jnp.float32),
    )


def fused_kernel_inputs(config, batch, seed):
    """kda_decode_fused's arrays (pre-conv rows, gate pre-activations, window, state) and random DecodeWeights."""
    heads, dim, taps = config.num_attention_heads, config.head_dim, config.short_conv_kernel_size
    r = np.random.default_rng(seed)

    def normal(*shape, dtype=jnp.bfloat16):
        return jnp.asarray(r.normal(size=shape), jnp.float32).astype(dtype)

    rows = [normal(batch, heads, dim) for _ in range(4)] + [normal(batch, heads), normal(batch, heads, dim)]
    state = random_kda_state(config, batch, seed)
    window = state.conv_window.reshape(batch, taps - 1, 3, heads, dim)
    conv = [normal(heads, dim, taps, dtype=jnp.float32) for _ in range(3)]
    weights = DecodeWeights(*conv, normal(heads, dim, dtype=jnp.float32), jnp.zeros((heads,), jnp.float32), normal(dim))
    return rows, window, state.recurrent_state, weights


def bench_decode_fused(config, batch, iters, copy_bytes_per_s, backend, tiles_list, steps_per_call):
    """One KDA layer's decode step under both kda_decode policies, then the fused kernel alone over tiles_list
    and the recurrence kernel alone: a row of the table."""
    graph, params = nnx.split(KimiDeltaAttention(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    x = jnp.asarray(np.random.default_rng(batch).normal(size=(batch, 1, config.hidden_size)), jnp.bfloat16)

    def layer_step(mode):
        policy = ExecutionPolicy(kernel_backend=backend, kda_mode="recurrent", kda_decode=mode)

        def advance(carried, x, params):  # carried: (state, the outputs' sum, which keeps every output alive)
            y, state = nnx.merge(graph, params)(x, carried[0], policy=policy)
            return state, carried[1] + y

        return advance

    def fresh():
        return random_kda_state(config, batch, seed=batch), jnp.zeros_like(x)

    once = {mode: jax.jit(layer_step(mode))(fresh(), x, params) for mode in ("separate", "fused")}
    err_y = rel_error(once["fused"][1].astype(jnp.float32), once["separate"][1].astype(jnp.float32))
    err_s = rel_error(once["fused"][0].recurrent_state, once["separate"][0].recurrent_state)
    layer_s = {
        mode: seconds_per_step(layer_step(mode), fresh(), x, params, iters=iters, steps_per_call=steps_per_call)
        for mode in ("separate", "fused")
    }
    rows, window, state, weights = fused_kernel_inputs(config, batch, seed=batch)
    interpret = backend.startswith("interpret")
    kernel_s = {}
    for tiles in tiles_list:
        fused = functools.partial(
            kda_decode_fused_gpu,
            scale=config.head_dim**-0.5,
            lower_bound=config.kda_lower_bound if config.kda_safe_gate else None,
            eps=config.rms_norm_eps,
            tiles=tiles,
            interpret=interpret,
        )
        kernel_s[tiles] = seconds_per_step(
            lambda s, fused=fused: fused(*rows, window, s, weights)[2],
            jnp.copy(state),
            iters=iters,
            steps_per_call=steps_per_call,
        )
    q, k, v, f, b, _ = rows
    step = functools.partial(kda_decode_step_gpu, scale=config.head_dim**-0.5, interpret=interpret)
    g, beta = f.astype(jnp.float32) - 1.0, jax.nn.sigmoid(b.astype(jnp.float32))
    step_s = seconds_per_step(
        lambda s: step(q, k, v, g, beta, s)[1], jnp.copy(state), iters=iters, steps_per_call=steps_per_call
    )
    traffic = 2 * state.nbytes
    for tiles, seconds in kernel_s.items():
        print(
            f"decode-fused B={batch} block_v={tiles.block_v} num_warps={tiles.num_warps} "
            f"value_splits={tiles.value_splits or 'rule'}: kernel "
            f"{seconds * 1e6:.1f} us ({traffic / seconds / 1e12:.2f} TB/s)"
        )
    best = min(kernel_s, key=kernel_s.get)
    print(
        f"decode-fused B={batch}: layer step separate {layer_s['separate'] * 1e6:.1f} us, fused "
        f"{layer_s['fused'] * 1e6:.1f} us; recurrence kernel alone {step_s * 1e6:.1f} us; fused vs separate: "
        f"y {err_y:.1e}, state {err_s:.1e}"
    )
    share = traffic / kernel_s[best] / copy_bytes_per_s
    label = f"({best.block_v}, {best.num_warps}, {best.value_splits or 'rule'})"
    return batch, layer_s["separate"], layer_s["fused"], step_s, kernel_s[best], label, share, err_y


def print_decode_fused_table(rows) -> None:
    print(
        "\n| B | layer step, separate | layer step, fused | separate / fused | recurrence kernel alone "
        "| fused kernel alone (block_v, warps, value splits) | fused kernel % of copy | rel. err y |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for batch, separate_s, fused_s, step_s, kernel_s, label, share, err in rows:
        print(
            f"| {batch} | {separate_s * 1e6:.1f} us | {fused_s * 1e6:.1f} us | {separate_s / fused_s:.2f}x | "
            f"{step_s * 1e6:.1f} us | {kernel_s * 1e6:.1f} us {label} | {100 * share:.0f}% | {err:.1e} |"
        )


# the tuned tables' settings on this device (`pallas_kernels/kda/tuned.py`, `experimental.kda_fused`)
PHASE2_DEFAULT = lookup(tuned.CHUNK_INTER, dtype=jnp.bfloat16)
PHASE2 = {"gpu_triton_short": lookup(tuned.CHUNK_INTER_SHORT, dtype=jnp.bfloat16)}  # the others': PHASE2_DEFAULT
PHASE1 = {  # variant of chunk_kda: (its phase 1, that phase 1's default tiles)
    "gpu_triton": (intra_chunk, lookup(tuned.CHUNK_INTRA, dtype=jnp.bfloat16)),
    "gpu_triton_fused": (kda_fused.fused_intra_chunk, lookup(kda_fused.CHUNK_FUSED, dtype=jnp.bfloat16)),
    "gpu_triton_fused_wy": (kda_fused.fused_wy_intra_chunk, lookup(kda_fused.CHUNK_FUSED_WY, dtype=jnp.bfloat16)),
    "gpu_triton_any_gate": (intra_chunk_any_gate, lookup(tuned.CHUNK_INTRA, dtype=jnp.bfloat16)),
    "gpu_triton_short": (short_chunk_parts, lookup(tuned.CHUNK_SHORT, dtype=jnp.bfloat16)),
}
PREFILL_VARIANTS = [  # (variant of chunk_kda, phase 1's tiles replaced over its defaults[, phase 2's]): the GPU's
    # default first, the 64-token kernel, then the lab's
    ("gpu_triton_short", {}),
    ("gpu_triton", {}),
    ("gpu_triton_fused", {}),
    ("gpu_triton_fused", {"num_warps": 8}),
    ("gpu_triton_fused_wy", {}),
    ("gpu_triton_any_gate", {}),  # for gates below -5, on the same safe gates
    ("gpu_triton_short", {"chunks": 2}),
    ("gpu_triton_short", {"num_warps": 4}),
    ("gpu_triton_short", {"num_warps": 8}),
    ("gpu_triton_short", {}, {"state_rows": False, "num_stages": 2}),  # phase 2 as the 64-token kernel's
    ("gpu_triton_short", {}, {"num_stages": 4}),
    ("gpu_triton_short", {}, {"block_v": 32}),  # twice the programs, 32 state rows a product
    ("gpu_triton_short", {"chunk": 32}),  # half the state pass's steps, twice the work a step
    ("gpu_triton_short", {"chunk": 32, "num_warps": 8}),
    ("gpu_triton_short", {"paired": True}),  # the state pass's w and folded-q products as one, no a_qk product
    ("gpu_triton", {}, {"state_rows": True, "num_stages": 3}),
]


def phase1_kernels(name, q, k, v, g, beta, tiles, interpret):
    """Phase 1's pallas_calls as jitted functions of their own inputs (each timed alone), with the inputs each
    needs: [(name, fn, args)], in order: the keys, block-row and WY-factors kernels of gpu_triton*, the chunk-wide
    products and WY-factors kernels of gpu_triton_fused_wy (none for gpu_triton_fused and gpu_triton_short: one
    kernel)."""
    if name in ("gpu_triton_fused", "gpu_triton_short"):
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


def bench_prefill(
    batch,
    length,
    iters,
    jnp_baseline: bool,
    interpret: bool = False,
    heads: int = HEADS,
    names=None,
    sweep=True,
    fla=True,
):
    """Every PREFILL_VARIANTS entry (of the variants `names`, None: all; without `sweep` only their default tiles)
    vs fla (on the GPU) or, interpreted on the CPU or without `fla`, checked against the jnp chunked form (its time
    not taken; interpreted, a smoke run of the wiring: the times say nothing)."""
    q, k, v, g, beta = random_inputs(batch, length, seed=length, heads=heads)
    jq, jk, jv = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    jg, jbeta = jnp.asarray(g), jnp.asarray(beta)
    tokens = batch * length
    if interpret or not fla:
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
    rows = [row for row in PREFILL_VARIANTS if row[0] in (names or [row[0]]) and (sweep or row[1:] == ({},))]
    for name, overrides, *inter in rows:
        inter = inter[0] if inter else {}
        tiles = tuned.ChunkTiles(
            intra=dataclasses.replace(PHASE1[name][1], **overrides),
            inter=dataclasses.replace(PHASE2.get(name, PHASE2_DEFAULT), **inter),
        )
        fn = jax.jit(functools.partial(kernel("chunk_kda", name), scale=DIM**-0.5, tiles=tiles, interpret=interpret))
        label = " ".join(
            [name]
            + [f"intra_{key}={value}" for key, value in overrides.items()]
            + [f"inter_{key}={value}" for key, value in inter.items()]
        )
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


SEGMENT_SWEEP = (4, 8, 16, 32)  # segment counts --segmented times beside the rule's
SEGMENTED_HEADS = (8, 64)


def nudge_query(q_BTHK, outputs):
    """q nudged by the last call's output o [B, T, H, V] (V = K here)."""
    return q_BTHK + (1e-3 * outputs[0]).astype(q_BTHK.dtype)


def bench_segmented(
    batch,
    length,
    heads,
    iters,
    interpret: bool = False,
    sweep=SEGMENT_SWEEP,
    names=None,
    profile_dir=None,
    fla: bool = True,
):
    """chunk_kda (safe gates, bf16; each variant of `names`, None: the platform's) unsplit and split over each
    segment count of the rule and `sweep`, vs fla on the GPU or, interpreted on the CPU or without `fla`, vs the
    jnp chunked form (untimed): the table's rows. profile_dir: a Perfetto trace of 3 calls of each row in
    profile_dir/H{heads}_{variant}_{count} (scripts/trace_summary.py DIR --steps 3), and the row's kernel device
    time a call printed beside its wall time (a lone call's wall time also holds its dispatch); each row also timed
    as CHAINED calls in one program (q nudged by the last output, as a prefill chains its layers)."""
    q, k, v, g, beta = random_inputs(batch, length, seed=length, heads=heads)
    jq, jk, jv = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    jg, jbeta = jnp.asarray(g), jnp.asarray(beta)
    backend = "interpret_gpu" if interpret else "pallas_gpu"
    if interpret or not fla:
        ref_o, ref_state = (np.asarray(x, np.float32) for x in jax.jit(kda_chunked)(jq, jk, jv, jg, jbeta))
        ref_s, ref_name = float("nan"), "jnp chunked"
    else:
        ref_o, ref_state, ref_s = fla_prefill(q, k, v, g, beta, iters)
        ref_name = "fla"
    rule = segment_count(batch, heads, length, device_cores(backend), q.shape[-1] + v.shape[-1])
    print(
        f"prefill B={batch} T={length} H={heads}: {ref_name} {ref_s * 1e3:.2f} ms; the rule's segments: {rule} "
        f"({device_cores(backend)} cores)"
    )
    rows = []
    for variant, count in itertools.product(names or [None], dict.fromkeys((1, rule, *sweep))):
        fn = jax.jit(
            functools.partial(chunk_kda, gate_lower_bound=-5.0, backend=backend, variant=variant, segments=count)
        )
        o, state = fn(jq, jk, jv, jg, jbeta)
        err_o, err_s = rel_error(o.astype(jnp.float32), ref_o), rel_error(state, ref_state)
        seconds = median_seconds(fn, jq, jk, jv, jg, jbeta, iters=iters)
        chained_s = per_call_seconds(fn, nudge_query, jq, jk, jv, jg, jbeta, iters=iters, calls=CHAINED)
        device = ""
        if profile_dir is not None:
            directory = pathlib.Path(profile_dir) / f"H{heads}_{variant or 'default'}_{count}"
            with jax.profiler.trace(str(directory), create_perfetto_trace=True):
                for _ in range(PROFILED_CALLS):
                    jax.block_until_ready(fn(jq, jk, jv, jg, jbeta))
            device = f", device {trace.device_seconds(directory, PROFILED_CALLS) * 1e3:.2f} ms"
        label = "unsplit" if count == 1 else f"{count} segments" + (" (the rule)" if count == rule else "")
        label = f"{variant or 'default'} {label}"
        print(
            f"  {label}: {seconds * 1e3:.2f} ms{device}, {CHAINED} chained {chained_s * 1e3:.2f} ms a call "
            f"({batch * length / seconds / 1e6:.2f} Mtok/s, "
            f"{ref_name} / ours {ref_s / seconds:.2f}x); vs {ref_name}: o {err_o:.1e}, state {err_s:.1e}"
        )
        rows.append((f"prefill H={heads} {label}", batch, length, seconds, ref_s, None, err_o))
    return rows


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
        choices=sorted({row[0] for row in PREFILL_VARIANTS}),
        help="prefill: time only this chunk_kda variant's rows (repeatable; default all); --segmented: split this "
        "variant (repeatable; default the platform's)",
    )
    parser.add_argument(
        "--no-fla",
        action="store_true",
        help="prefill: no fla (its autotuning at T=32768 takes minutes on a fresh machine): the variants checked "
        "against the jnp chunked form and timed against each other only (--segmented too)",
    )
    parser.add_argument(
        "--default-tiles",
        action="store_true",
        help="prefill: only each variant's row at its default tiles (no tile sweep)",
    )
    parser.add_argument(
        "--decode-fused",
        action="store_true",
        help="only a KDA layer's decode step: separate ops vs the fused kernel (no fla needed)",
    )
    parser.add_argument("--preset", default="ling-3.0-flash", help="--decode-fused: the preset whose KDA layer runs")
    parser.add_argument(
        "--segmented",
        action="store_true",
        help="only the prefill split over sequence segments vs unsplit vs fla (B=1 long prompts)",
    )
    parser.add_argument(
        "--heads",
        type=int,
        action="append",
        help=f"--segmented: heads to time (repeatable; default {' and '.join(map(str, SEGMENTED_HEADS))})",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="--segmented: a Perfetto trace of 3 calls of each row under DIR (scripts/trace_summary.py), and each "
        "row's kernel device time a call",
    )
    parser.add_argument(
        "--jnp-baseline",
        action="store_true",
        help="also time the jnp chunked prefill under XLA (slow: ~180 ms a call at T=32768)",
    )
    args = parser.parse_args(argv)
    if args.decode_fused:
        return decode_fused_main(parser, args)
    if args.segmented:
        return segmented_main(parser, args)
    if args.no_fla and not args.prefill_only:
        parser.error(
            "--no-fla needs --prefill-only or --segmented (the decode rows time fla's recurrent kernel beside ours)"
        )
    if jax.default_backend() != "gpu":
        if not args.quick or args.decode_only:
            parser.error(
                f"needs a GPU (jax.default_backend() is {jax.default_backend()!r}); without one, "
                "--quick runs the prefill variants interpreted at a small size (a check of the wiring)"
            )
        print(f"jax {jax.__version__}; no GPU: prefill variants in interpret mode, H={CPU_HEADS} (times meaningless)")
        rows = [
            bench_prefill(
                1, 3 * 64, 1, False, interpret=True, heads=CPU_HEADS, names=args.variant, sweep=not args.default_tiles
            )
        ]
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
            iters = max(5, args.iters // 10)
            sweep = not args.default_tiles
            rows.append(
                bench_prefill(
                    batch, length, iters, args.jnp_baseline, names=args.variant, sweep=sweep, fla=not args.no_fla
                )
            )
    print_table(rows)
    return 0


def print_table(rows) -> None:
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


def segmented_main(parser, args) -> int:
    if jax.default_backend() == "gpu":
        sizes, heads_list = args.prefill_size or ((1, 32768),), args.heads or SEGMENTED_HEADS
        iters, interpret, sweep = max(5, args.iters // 10), False, SEGMENT_SWEEP
        print(f"jax {jax.__version__}; {jax.devices()[0].device_kind}")
    elif args.quick:
        sizes, heads_list, iters, interpret, sweep = ((1, 4 * 64 + 37),), (CPU_HEADS,), 1, True, (2, 4)
        print(f"jax {jax.__version__}; no GPU: interpreted, H={CPU_HEADS} (times meaningless)")
    else:
        parser.error(f"--segmented needs a GPU (jax.default_backend() is {jax.default_backend()!r}) or --quick")
    print_table(
        [
            row
            for batch, length in sizes
            for heads in heads_list
            for row in bench_segmented(
                batch, length, heads, iters, interpret, sweep, args.variant, args.profile, not args.no_fla
            )
        ]
    )
    return 0


def decode_fused_main(parser, args) -> int:
    if jax.default_backend() == "gpu":
        config, backend, steps_per_call = preset(args.preset), "pallas_gpu", STEPS_PER_CALL
        batches, tiles = FUSED_DECODE_BATCHES["quick" if args.quick else "full"], FUSED_DECODE_TILES
        copy = copy_bandwidth(args.iters)
        print(f"jax {jax.__version__}; {args.preset}'s KDA layer; device copy {copy / 1e12:.2f} TB/s (read + write)")
    elif args.quick:
        config, backend, steps_per_call = preset("tiny"), "interpret_gpu", 1
        batches, tiles, copy = FUSED_DECODE_BATCHES["cpu"], FUSED_DECODE_TILES[:1], float("nan")
        print(f"jax {jax.__version__}; no GPU: the tiny preset's KDA layer, interpreted (times meaningless)")
    else:
        parser.error(f"--decode-fused needs a GPU (jax.default_backend() is {jax.default_backend()!r}) or --quick")
    iters = 1 if backend == "interpret_gpu" else args.iters
    print_decode_fused_table(
        [bench_decode_fused(config, b, iters, copy, backend, tiles, steps_per_call) for b in batches]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
