"""Sharding, expressed once: logical axis names (on every parameter and cache array) -> mesh axes.

Mesh axes: `data` and `fsdp` split the batch (fsdp also splits the weights' embed dimension, gathered on
use), `tensor` splits attention heads, MLP and expert widths and the vocabulary, `expert` splits the
routed experts (and the batch outside the MoE: attention is data parallel across the expert axis).
`RULES` is the only place that says which logical axis goes where; `make_mesh` builds a mesh, and
`param_shardings` / `cache_shardings` turn the annotations into NamedShardings, refusing (with the
parameter's name) any dimension that its mesh axes do not divide.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ling_jax.cache import KDAState, LingCache, MLAState, MTPCache

MESH_AXES = ("data", "fsdp", "tensor", "expert")
BATCH_AXES = ("data", "fsdp", "expert")

# logical axis -> mesh axes (a tuple: the dimension is split over their product); absent = replicated
RULES: dict[str, tuple[str, ...]] = {
    "batch": BATCH_AXES,
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "embed_table": (),  # the input embedding's D: a gather from an fsdp-split table would be re-gathered whole
    "heads": ("tensor",),  # attention heads, also head-major flattened dims (H * head_dim)
    "mlp": ("tensor",),  # dense MLP / shared expert width
    "experts": ("expert",),
    "expert_mlp": ("tensor",),  # routed expert width
    "kv_latent": (),  # the 512 + 64 latent: every head reads all of it
    "q_lora": (),
    "kda_lora": (),
    "router": (),  # routing needs every expert's score on every device
    "norm": (),
    "conv_taps": (),
    "embed_pair": (),  # MTP eh_proj input [enorm(embed) ; hnorm(hidden)]
    "cache_length": (),
    "state_dim": (),
    "conv_channels": (),
    # the VL vision tower and projector (ling_jax.vision) run replicated: well under 1B parameters next to the
    # experts, and their [patches, width] activations are far smaller than the language model's
    "vision_embed": (),
    "vision_positions": (),
    "vision_qkv": (),
    "vision_out": (),
    "vision_mlp": (),
    "vision_merged": (),
    "vision_merged_in": (),
    "vision_proj": (),
    "vision_proj_in": (),
}


class ShardingError(ValueError):
    """A mesh that does not fit the model (a dimension not divisible by its mesh axes, unknown axes)."""


def make_mesh(shape: Mapping[str, int] | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over `devices` (default: all) with axes (data, fsdp, tensor, expert).

    shape: sizes for some of the axes, e.g. {"tensor": 2, "expert": 4}; unnamed axes are 1, except that when
    shape is None every device goes to `expert`. The product must equal the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = check_mesh_shape({"expert": len(devices)} if shape is None else shape)
    sizes = [shape.get(axis, 1) for axis in MESH_AXES]
    if math.prod(sizes) != len(devices):
        raise ShardingError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                            f"but {len(devices)} are available")
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def check_mesh_shape(shape: Mapping[str, int]) -> dict[str, int]:
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise ShardingError(f"unknown mesh axes {unknown}: the axes are {MESH_AXES}")
    if any(not isinstance(n, int) or n < 1 for n in shape.values()):
        raise ShardingError(f"mesh axis sizes must be positive integers, got {dict(shape)}")
    return dict(shape)


def parse_mesh(text: str) -> dict[str, int]:
    """'tensor=2,expert=4' -> {"tensor": 2, "expert": 4} (the CLI's --mesh)."""
    shape = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, size = item.partition("=")
        if not size.strip().isdigit():
            raise ShardingError(f"--mesh expects axis=size pairs like 'tensor=2,expert=4', got {item!r}")
        shape[name.strip()] = int(size)
    return check_mesh_shape(shape)


def mesh_axes_for(logical: str | None, rules: Mapping[str, tuple[str, ...]] = RULES) -> tuple[str, ...]:
    if logical is None:
        return ()
    if logical not in rules:
        raise ShardingError(f"logical axis {logical!r} has no rule; known: {sorted(rules)}")
    return rules[logical]


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], axis_sizes: Mapping[str, int], *, name: str,
                    rules: Mapping[str, tuple[str, ...]] = RULES) -> PartitionSpec:
    """PartitionSpec for one array over a mesh of `axis_sizes` (mesh.shape); each mesh axis is used at most once
    (first dimension wins)."""
    used: set[str] = set()
    spec = []
    for logical, size in zip(axes, shape):
        mesh_axes = tuple(a for a in mesh_axes_for(logical, rules)
                          if axis_sizes.get(a, 1) > 1 and a not in used)
        ways = math.prod(axis_sizes[a] for a in mesh_axes)
        if size % ways:
            raise ShardingError(f"{name}: dimension {logical!r} of size {size} is not divisible by mesh axes "
                                f"{mesh_axes} ({ways} ways) in shape {tuple(shape)}")
        used.update(mesh_axes)
        spec.append(mesh_axes if len(mesh_axes) > 1 else (mesh_axes[0] if mesh_axes else None))
    return PartitionSpec(*spec)


def _path_name(path) -> str:
    return ".".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in path)


def param_specs(state: nnx.State, axis_sizes: Mapping[str, int],
                rules: Mapping[str, tuple[str, ...]] = RULES) -> nnx.State:
    """PartitionSpec for every parameter of `state` (nnx.state(model)), from its logical axis annotations, for
    a mesh of `axis_sizes` (no devices needed: the converter plans for a mesh it does not run on)."""

    def one(path, variable):
        axes = variable.get_metadata().get("out_sharding")
        if axes is None:
            raise ShardingError(f"{_path_name(path)} has no logical axis annotation")
        return variable.replace(logical_to_spec(axes, variable.shape, axis_sizes, name=_path_name(path), rules=rules))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def param_shardings(state: nnx.State, mesh: Mesh, rules: Mapping[str, tuple[str, ...]] = RULES) -> nnx.State:
    """NamedSharding for every parameter of `state` (nnx.state(model)) over `mesh`."""
    return jax.tree.map(lambda v: v.replace(NamedSharding(mesh, v.get_value())), param_specs(state, mesh.shape, rules),
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules: Mapping[str, tuple[str, ...]] = RULES) -> nnx.Module:
    """Places every parameter of `model` on `mesh` according to the rules (in place); returns the model."""
    state = nnx.state(model)
    shardings = param_shardings(state, mesh, rules)
    nnx.update(model, jax.tree.map(jax.device_put, state, shardings,
                                   is_leaf=lambda x: isinstance(x, nnx.Variable)))
    return model


def batch_axes(mesh, batch: int) -> tuple[str, ...]:
    """The batch axes a dimension of `batch` rows (or tokens) is split over: each of data, fsdp, expert (of size
    > 1) that still divides it."""
    axes, ways = [], 1
    for axis in BATCH_AXES:
        size = mesh.shape.get(axis, 1)
        if size > 1 and batch % (ways * size) == 0:
            axes.append(axis)
            ways *= size
    return tuple(axes)


def batch_spec(mesh: Mesh, batch: int, *trailing: str | None) -> PartitionSpec:
    """[B, ...] arrays: B over `batch_axes`, the trailing dimensions as given."""
    return PartitionSpec(batch_axes(mesh, batch) or None, *trailing)


# per-sequence cache arrays: logical axes after the leading batch dimension
CACHE_AXES = {
    KDAState: {"conv_window": ("conv_taps", "conv_channels"), "recurrent_state": ("heads", "state_dim", "state_dim")},
    MLAState: {"latent": ("cache_length", "kv_latent")},  # the latent is shared by all heads: batch split only
}


def _layer_specs(state: KDAState | MLAState, mesh: Mesh, batch: int, name: str):
    fields = {}
    for field, axes in CACHE_AXES[type(state)].items():
        shape = getattr(state, field).shape
        rest = logical_to_spec(axes, shape[1:], mesh.shape, name=f"{name}.{field}")
        fields[field] = batch_spec(mesh, batch, *rest)
    return type(state)(**fields)


def cache_shardings(cache: LingCache | MTPCache, mesh: Mesh):
    """NamedShardings for a cache: batch over the batch axes that divide it, KDA states' heads over `tensor`."""
    batch = cache.lengths.shape[0]
    if isinstance(cache, MTPCache):
        specs = MTPCache(layer=_layer_specs(cache.layer, mesh, batch, "mtp"), lengths=batch_spec(mesh, batch))
    else:
        specs = LingCache(layers=tuple(_layer_specs(s, mesh, batch, f"layers.{i}") for i, s in enumerate(cache.layers)),
                          lengths=batch_spec(mesh, batch))
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))
