"""Helpers shared by the benchmarks in this package and scripts/check_multi_gpu.py: timing, errors, the
full-width Ling-3.1-flash slice with random weights (on one device or straight into a mesh's shardings), a
filled decode cache, the decode-step timer and the header line saying what ran where."""

from __future__ import annotations

import datetime
import functools
import pathlib
import statistics
import subprocess
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from benchmarks import trace
from ling_jax import LingConfig
from ling_jax.cache import KDAState, LingCache, MLAState
from ling_jax.config import KDA, MLA, MOE
from ling_jax.generation.end_tokens import end_bitmask
from ling_jax.generation.generator import (
    DECODE_READ_GROUP,
    DecodeState,
    Drafts,
    _decode_group,
    _speculative_group,
    cache_length,
)
from ling_jax.generation.sampling import SamplingArrays, SamplingParams
from ling_jax.generation.static_model import split_model
from ling_jax.presets import preset
from ling_jax.sharding import param_shardings


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def run_header(name: str) -> str:
    """'# bench_NAME <date> commit <HEAD's short hash> on <device kind>': a benchmark's first output line."""
    return f"# bench_{name} {datetime.date.today()} commit {_commit()} on {jax.devices()[0].device_kind}"


def median_seconds(fn, *args, iters: int) -> float:
    """Median seconds per call of a jitted fn, synchronised, after two warm-up calls."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


PROFILE_STEPS = 5  # decode steps `time_decode` profiles
CHAINED_CALLS = 32


def chained(call, nudge, calls: int = CHAINED_CALLS):
    """`calls` calls in one jitted program, args[0] <- nudge(args[0], the last call's output) between them:
    timings free of the ~90 us per-dispatch floor of a lone small call, without letting XLA merge the calls."""

    def run(first, *rest):
        for _ in range(calls):
            first = nudge(first, call(first, *rest))
        return first

    return jax.jit(run)


def per_call_seconds(call, nudge, *args, iters: int, calls: int = CHAINED_CALLS) -> float:
    return median_seconds(chained(call, nudge, calls), *args, iters=iters) / calls


def rel_error(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def copy_bandwidth(iters: int, nbytes: int = 4 << 30) -> float:
    """Bytes per second (read + written) of an fp32 elementwise scale over `nbytes`: the bandwidth ceiling."""
    x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
    return 2 * nbytes / median_seconds(jax.jit(lambda a: a * 1.0001), x, iters=iters)


def flash_slice_config(layers: int, quick: bool) -> LingConfig:
    """Ling-3.1-flash at full width (hidden 4096, 64 heads, 512 experts) with `layers` decoder layers, all MoE,
    an MLA layer every 8th counting back from the last (8 layers: 7 KDA + 1 MLA, like the preset's layers
    8-15; 72: the preset's schedule), no MTP layer. quick: a narrow model (hidden 512, 64 experts) for smoke
    tests on a CPU."""
    config = preset("ling-3.1-flash")
    group = config.layer_types.index(MLA) + 1  # the preset's layer group: 7 KDA + 1 MLA
    config = config.replace(
        num_hidden_layers=layers,
        layer_types=tuple(MLA if (layers - 1 - i) % group == 0 else KDA for i in range(layers)),
        mlp_layer_types=(MOE,) * layers,
        num_nextn_predict_layers=0,
        expert_swiglu_limit_list=(),
        share_expert_swiglu_limit_list=(),
    )
    if quick:
        config = config.replace(
            hidden_size=512,
            num_attention_heads=8,
            moe_intermediate_size=128,
            num_experts=64,
            n_group=8,
            topk_group=4,
            shared_expert_intermediate_size=128,
            vocab_size=4096,
        )
    return config


def first_layers(config: LingConfig, layers: int) -> LingConfig:
    """`config` with only its first `layers` decoder layers (every per-layer list cut to them; the MTP layer kept):
    a whole preset's layers at full width on a GPU too small for all of them."""
    if not 0 < layers <= config.num_hidden_layers:
        raise ValueError(f"--layers: expected 1 to {config.num_hidden_layers} (the preset's layers), got {layers}")
    per_layer = ("layer_types", "mlp_layer_types", "expert_swiglu_limit_list", "share_expert_swiglu_limit_list")
    cut = {name: getattr(config, name)[:layers] for name in per_layer if len(getattr(config, name))}
    return config.replace(num_hidden_layers=layers, **cut)


def init_on_mesh(build: Callable[[], nnx.Module], mesh: Mesh) -> nnx.Module:
    """The module `build()` makes (random init), its parameters created straight into their shardings on `mesh`
    (`ling_jax.sharding` rules), so nothing full-size lands on one device. The random values do not depend on
    the mesh (partitionable threefry): the same `build` gives the same weights on one device and on eight."""
    graphdef, abstract = nnx.split(nnx.eval_shape(build))
    state = jax.jit(lambda: nnx.state(build()), out_shardings=param_shardings(abstract, mesh))()
    return nnx.merge(graphdef, state)


def filled_cache(model, batch: int, context: int, extra: int) -> LingCache:
    """A cache that holds `context` tokens and room for `extra` more, its length rounded up as `Generator` rounds
    it (`cache_length`: the decode kernels pick their variant by it); random latents and small random KDA states."""
    config = model.config
    cache = LingCache.create(config, batch, cache_length(context, extra, mtp=0), model.dtype)
    keys = iter(jax.random.split(jax.random.key(7), 2 * len(cache.layers)))
    layers = []
    for state in cache.layers:
        if isinstance(state, KDAState):
            layers.append(
                KDAState(
                    conv_window=state.conv_window,
                    recurrent_state=0.01 * jax.random.normal(next(keys), state.recurrent_state.shape),
                )
            )
        else:
            layers.append(MLAState(latent=jax.random.normal(next(keys), state.latent.shape, state.latent.dtype)))
    return LingCache(layers=tuple(layers), lengths=jnp.full((batch,), context, jnp.int32))


def committed(tree):
    """`tree`'s arrays committed to where they are: a program's outputs are, and jit compiles a call on uncommitted
    arguments (jnp.zeros, random) apart from the same call on committed ones (a second compile of every timed
    program)."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding), tree)


def time_decode(model, cache: LingCache, steps: int, profile_dir: str | None = None) -> float:
    """Seconds per decode step, as `Generator` runs them: each step is dispatched before the previous one
    finishes (its token feeds the next step on the device), so host dispatch overlaps device work. With
    profile_dir, PROFILE_STEPS more steps run under the JAX profiler, which writes a Perfetto trace there, and the
    step's compiled HLO text goes to profile_dir/trace.HLO_FILE (`benchmarks.trace.layer_kind_report` reads both)."""
    static, params = split_model(model)  # a flat list: an nnx.State's flattening costs ~1 ms of host time a call

    def step(params, cache, token_B):
        out = static.merge(params)(token_B[:, None], cache=cache)
        with jax.named_scope("sampling"):
            return jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32), out.cache

    step = jax.jit(step, donate_argnums=1)
    token, cache = committed((jnp.zeros((cache.lengths.shape[0],), jnp.int32), cache))
    for _ in range(3):
        token, cache = step(params, cache, token)
    token.block_until_ready()
    start = time.perf_counter()
    for _ in range(steps):
        token, cache = step(params, cache, token)
    token.block_until_ready()
    seconds = (time.perf_counter() - start) / steps
    if profile_dir:
        pathlib.Path(profile_dir).mkdir(parents=True, exist_ok=True)
        # the program the profiled steps run (these arguments' shardings); compiled again, once
        (pathlib.Path(profile_dir) / trace.HLO_FILE).write_text(step.lower(params, cache, token).compile().as_text())
        with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
            for _ in range(PROFILE_STEPS):
                token, cache = step(params, cache, token)
            token.block_until_ready()
    return seconds


def time_speculation(
    model,
    batch: int,
    context: int,
    num_drafts: int,
    programs: int = 4,
    profile_dir: pathlib.Path | None = None,
    specialise: bool = False,
) -> tuple[float, float]:
    """(seconds per decode step, seconds per speculative round of num_drafts drafts) of `Generator`'s own programs
    (`_decode_group`, `_speculative_group`: DECODE_READ_GROUP steps or rounds a program, greedy, every row running,
    no EOS), each dispatched back to back over a cache of `context` tokens (`filled_cache`; the MTP layer's cache as
    long, zeros). With random weights hardly a draft is accepted: a round costs what a round of any acceptance
    does, and the break-even acceptance is round / step - 1 tokens a round. With profile_dir, one more call of each
    program runs under the profiler: profile_dir/decode_group and profile_dir/speculative_group each get its trace
    and compiled HLO (`scripts/trace_summary.py DIR --steps DECODE_READ_GROUP` reads one). specialise: the
    programs traced for greedy sampling alone (`SamplingArrays.from_params(specialise=True)`: no `lax.cond`)."""
    config = model.config
    static, leaves = split_model(model)
    extra = programs * DECODE_READ_GROUP * (num_drafts + 1) + 16
    arrays = SamplingArrays.from_params([SamplingParams(temperature=0.0)] * batch, specialise=specialise)
    decode = functools.partial(_decode_group, static, DECODE_READ_GROUP, leaves)
    plain = DecodeState.create(filled_cache(model, batch, context, extra), jnp.zeros((batch, config.vocab_size), bool))
    step_s = _per_call(
        lambda state: decode(state, arrays)[1],
        plain,
        programs,
        profile_dir,
        "decode_group",
        lambda state: decode.func.lower(*decode.args, state, arrays),
    )
    step_s /= DECODE_READ_GROUP
    cache = filled_cache(model, batch, context, extra)
    drafts = Drafts.create(config, batch, cache_length(context, extra, mtp=0), model.dtype)
    drafts = drafts.replace(cache=drafts.cache.replace(lengths=jnp.copy(cache.lengths)))  # each donated once
    state = DecodeState.create(cache, jnp.zeros((batch, config.vocab_size), bool), drafts)
    capacity_B = cache.lengths + extra
    no_end_BW = jnp.asarray(end_bitmask([()] * batch, config.vocab_size))
    active_B = jnp.ones((batch,), bool)
    speculate = functools.partial(_speculative_group, static, num_drafts, DECODE_READ_GROUP, leaves)
    round_s = _per_call(
        lambda state: speculate(state, arrays, active_B, capacity_B, no_end_BW)[1],
        state,
        programs,
        profile_dir,
        "speculative_group",
        lambda state: speculate.func.lower(*speculate.args, state, arrays, active_B, capacity_B, no_end_BW),
    )
    return step_s, round_s / DECODE_READ_GROUP


def _per_call(
    program: Callable,
    state,
    calls: int,
    profile_dir: pathlib.Path | None = None,
    name: str = "",
    lower: Callable | None = None,
) -> float:
    """Seconds per call of `program` (state -> next state, donated), after two untimed calls (the state committed
    first, as the program's outputs are, so that one compile serves both; weak types may still differ). With
    profile_dir, one more call under the profiler: its trace and `lower(state)`'s compiled HLO in
    profile_dir/name."""
    state = committed(state)
    for _ in range(2):
        state = program(state)
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(calls):
        state = program(state)
    jax.block_until_ready(state)
    seconds = (time.perf_counter() - start) / calls
    if profile_dir is not None:
        directory = pathlib.Path(profile_dir) / name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / trace.HLO_FILE).write_text(lower(state).compile().as_text())
        with jax.profiler.trace(str(directory), create_perfetto_trace=True):
            jax.block_until_ready(program(state))
    return seconds
