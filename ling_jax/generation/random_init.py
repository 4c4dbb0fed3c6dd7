"""A randomly initialised model (`generate.py --preset`) built by jitted programs straight into its shardings: each
device computes its own slice of every parameter, so no full-size parameter is ever on one device or host.

The values are the model's own initialisation (`build.model_rngs(seed)`: the same as building it eagerly with
`nnx.Rngs(seed)`; the random bits are partitionable, so every mesh gives the same model). Every parameter draws the
key `fold_in(key, n)` for the n-th draw of the build, so one decoder layer built alone, its stream's count started
where the whole model's build reaches it, gets the same values: one program per kind of layer (`init_programs`),
its start count an argument, initialises every layer of that kind; one more program the rest (the embedding, final
norm, lm_head and MTP layer: the whole model traced, XLA keeps their part). The programs are lowered here and
compiled side by side in threads (`compile_programs`; XLA releases the GIL), through the persistent compilation
cache where the entry point turned it on.

weights="stored" gives the quantisable parameters the block-FP8 form a published checkpoint stores
(`memory_plan.abstract_model`): the initial weight divided by one fixed scale per block (values up to
FP8_INIT_RANGE represented, beyond clipped) and rounded to e4m3, elementwise, so no dense copy of the weight is
ever held.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling_jax.build import build_model, model_rngs
from ling_jax.checkpoints.hf import STORED
from ling_jax.checkpoints.pieces import one_device_sharding
from ling_jax.config import LingConfig
from ling_jax.generation.memory_plan import abstract_model
from ling_jax.layers import DEFAULT_INIT_STD
from ling_jax.model import DecoderLayer, Embedding
from ling_jax.policy import ExecutionPolicy
from ling_jax.quantized import BlockFP8Weight, is_quantized
from ling_jax.sharding import param_shardings

FP8_INIT_RANGE = 4 * DEFAULT_INIT_STD  # initial weights are N(0, DEFAULT_INIT_STD): 4 standard deviations kept
E4M3_MAX = 448.0
LAYERS = ("model", "layers")
START = jax.ShapeDtypeStruct((), jnp.uint32)  # the programs' argument: the params stream's count at the start


@dataclasses.dataclass(frozen=True)
class InitProgram:
    """One initialising program: `lowered(start)` -> the stored values of a group of parameters; calls: one
    (parameter paths, start count) per group it initialises (one per decoder layer of its kind; the rest of the
    model: one group, its start unused)."""

    lowered: jax.stages.Lowered
    calls: tuple[tuple[tuple[tuple, ...], int], ...]


def _as_stored(dense: jax.Array, target) -> jax.Array | BlockFP8Weight:
    """`dense` in the form `target` (an abstract parameter) describes."""
    if not is_quantized(target):
        return dense
    if not isinstance(target, BlockFP8Weight):
        kind = type(target).__name__
        raise ValueError(f"random initialisation keeps FP8 weights only, not {kind}: use weights='bf16'")
    scale = np.float32(FP8_INIT_RANGE / E4M3_MAX)
    values = jnp.clip(dense.astype(jnp.float32) / scale, -E4M3_MAX, E4M3_MAX).astype(target.values.dtype)
    return BlockFP8Weight(values, jnp.full(target.scales.shape, scale, target.scales.dtype), target.block)


def random_model(
    config: LingConfig,
    *,
    mesh: jax.sharding.Mesh | None = None,
    weights: str = STORED,
    dtype=jnp.bfloat16,
    policy: ExecutionPolicy | None = None,
    seed: int = 0,
    progress: bool = False,
):
    """`config`'s model with random weights, initialised on the devices of `mesh` in the shardings of the logical
    axis rules (without a mesh: on this process's first device). weights: "stored" (block FP8 where a published
    checkpoint stores it) or "bf16" (every parameter dense in `dtype`). progress: one line on stderr at the end
    (the bytes, the programs, and the seconds lowering, compiling and running them took)."""
    start = time.perf_counter()
    abstract = abstract_model(config, weights=weights, dtype=dtype, policy=policy)
    graphdef, target = nnx.split(abstract)
    programs = init_programs(config, abstract, mesh=mesh, dtype=dtype, policy=policy, seed=seed)
    lowered = time.perf_counter()
    executables = compile_programs([p.lowered for p in programs])
    compiled = time.perf_counter()
    targets = dict(nnx.to_flat_state(target))
    flat = []
    for program, executable in zip(programs, executables):
        for paths, first in program.calls:
            values = executable(np.uint32(first))
            flat += [(p, targets[p].replace(value)) for p, value in zip(paths, values)]
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    if progress:
        leaves = jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
        gib = sum(leaf.nbytes for leaf in leaves) / 2**30
        print(
            f"initialised {gib:.2f} GiB of random parameters in {time.perf_counter() - start:.1f} s: "
            f"{len(programs)} programs lowered in {lowered - start:.1f} s, compiled in {compiled - lowered:.1f} s",
            file=sys.stderr,
        )
    return model


def init_programs(
    config: LingConfig,
    abstract: nnx.Module,
    *,
    mesh: jax.sharding.Mesh | None = None,
    dtype=jnp.bfloat16,
    policy: ExecutionPolicy | None = None,
    seed: int = 0,
) -> list[InitProgram]:
    """`random_model`'s programs for the parameters of `abstract` (`memory_plan.abstract_model(config, ...)`),
    lowered (not compiled): one per kind of decoder layer (attention, feed-forward, stored forms and shardings of
    its parameters), then one for the rest of the model."""
    target = nnx.state(abstract)
    if mesh is None:
        one = one_device_sharding()
        shardings = jax.tree.map(lambda _: one, target)
    else:
        shardings = param_shardings(target, mesh)
    targets = {p: v.get_value() for p, v in nnx.to_flat_state(target)}
    sharding_of = {p: v.get_value() for p, v in nnx.to_flat_state(shardings)}
    layer_paths: dict[int, list] = {}
    rest = []
    for path in targets:
        if path[:2] == LAYERS:
            layer_paths.setdefault(path[2], []).append(path)
        else:
            rest.append(path)

    def stored(module: nnx.Module, paths, prefix: tuple) -> list:
        dense = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(module))}
        return [_as_stored(dense[p[len(prefix) :]], targets[p]) for p in paths]

    def init_layer(start, *, layer: int, paths: tuple):
        rngs = model_rngs(seed)
        rngs.params.count.set_value(start)
        return stored(_decoder_layer(config, layer, dtype, rngs), paths, (*LAYERS, layer))

    def init_rest(_start, *, paths: tuple):
        return stored(build_model(config, rngs=model_rngs(seed), dtype=dtype, policy=policy), paths, ())

    def lower(init, paths: tuple, **static) -> jax.stages.Lowered:
        out_shardings = [sharding_of[p] for p in paths]
        return jax.jit(lambda start: init(start, paths=paths, **static), out_shardings=out_shardings).lower(START)

    kinds: dict[tuple, tuple[int, list]] = {}  # layers whose programs are the same: the first one, its calls
    start = _draws(lambda rngs: Embedding(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs))
    draws: dict[tuple, int] = {}  # per (attention, feed-forward) kind: the layer's draws
    for layer, paths in sorted(layer_paths.items()):
        kind = (config.layer_types[layer], config.mlp_layer_types[layer])
        same = (kind, tuple((p[3:], targets[p], sharding_of[p]) for p in paths))
        kinds.setdefault(same, (layer, []))[1].append((tuple(paths), start))
        if kind not in draws:
            draws[kind] = _draws(lambda rngs, layer=layer: _decoder_layer(config, layer, dtype, rngs))
        start += draws[kind]
    programs = [
        InitProgram(lower(init_layer, calls[0][0], layer=first), tuple(calls)) for first, calls in kinds.values()
    ]
    return [*programs, InitProgram(lower(init_rest, tuple(rest)), ((tuple(rest), 0),))]


def compile_programs(lowered: list[jax.stages.Lowered]) -> list[jax.stages.Compiled]:
    """Each of `lowered` compiled, side by side in a thread each (up to one per CPU core)."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(lowered), os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda program: program.compile(), lowered))


def _decoder_layer(config: LingConfig, layer: int, dtype, rngs: nnx.Rngs) -> DecoderLayer:
    """Decoder layer `layer` as `LingModel` builds it."""
    attention, mlp = config.layer_types[layer], config.mlp_layer_types[layer]
    return DecoderLayer(config, attention=attention, mlp=mlp, clip_layer=layer, dtype=dtype, rngs=rngs)


def _draws(build) -> int:
    """How many keys `build(rngs)` draws from the params stream (shapes only: nothing is computed)."""
    drawn = []

    def counted():
        rngs = model_rngs(0)
        rngs.params.count.set_value(np.uint32(0))  # a numpy count stays concrete while the build is traced
        build(rngs)
        drawn.append(int(rngs.params.count.get_value()))

    jax.eval_shape(counted)
    return drawn[0]
