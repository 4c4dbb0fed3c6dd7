"""A randomly initialised model (`generate.py --preset`) built by jitted programs straight into its shardings (one
program a few decoder layers: `_program_groups`): each device computes its own slice of every parameter, so no
full-size parameter is ever on one device or host.

The values are the model's own initialisation (`build.model_rngs(seed)`: the same as building it eagerly with
`nnx.Rngs(seed)`; the random bits are partitionable, so every mesh gives the same model). weights="stored" gives
the quantisable parameters the block-FP8 form a published checkpoint stores (`memory_plan.abstract_model`): the
initial weight divided by one fixed scale per block (values up to FP8_INIT_RANGE represented, beyond clipped) and
rounded to e4m3, elementwise, so no dense copy of the weight is ever held.
"""

from __future__ import annotations

import functools

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
from ling_jax.policy import ExecutionPolicy
from ling_jax.quantized import BlockFP8Weight, is_quantized
from ling_jax.sharding import param_shardings

LAYERS_PER_PROGRAM = 2
FP8_INIT_RANGE = 4 * DEFAULT_INIT_STD  # initial weights are N(0, DEFAULT_INIT_STD): 4 standard deviations kept
E4M3_MAX = 448.0


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
):
    """`config`'s model with random weights, initialised on the devices of `mesh` in the shardings of the logical
    axis rules (without a mesh: on this process's first device). weights: "stored" (block FP8 where a published
    checkpoint stores it) or "bf16" (every parameter dense in `dtype`)."""
    graphdef, target = nnx.split(abstract_model(config, weights=weights, dtype=dtype, policy=policy))
    if mesh is None:
        one = one_device_sharding()
        shardings = jax.tree.map(lambda _: one, target)
    else:
        shardings = param_shardings(target, mesh)
    targets = dict(nnx.to_flat_state(target))
    sharding_of = dict(nnx.to_flat_state(shardings))

    def init(paths: tuple) -> list:
        """The stored values of the parameters at `paths`: the whole model is traced, XLA keeps only their part."""
        model = build_model(config, rngs=model_rngs(seed), dtype=dtype, policy=policy)
        dense = dict(nnx.to_flat_state(nnx.state(model)))
        return [_as_stored(dense[p].get_value(), targets[p].get_value()) for p in paths]

    flat = []
    for paths in _program_groups(targets):
        out_shardings = [sharding_of[p].get_value() for p in paths]
        values = jax.jit(functools.partial(init, paths), out_shardings=out_shardings)()
        flat += [(p, targets[p].replace(value)) for p, value in zip(paths, values)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _program_groups(paths) -> list[tuple]:
    """The parameter paths in groups of LAYERS_PER_PROGRAM decoder layers (and one group of the rest), one
    initialising program each: XLA's compile time grows faster than the program (Ling-3.0-flash's 42 layers in one
    program: 205 s on a CPU, >300 s on an H200; in groups of 2: ~3.6 s each)."""
    groups: dict[int, list] = {}
    for path in paths:
        layer = path[2] if len(path) > 2 and path[:2] == ("model", "layers") else -LAYERS_PER_PROGRAM
        groups.setdefault(layer // LAYERS_PER_PROGRAM, []).append(path)
    return [tuple(group) for _, group in sorted(groups.items())]
