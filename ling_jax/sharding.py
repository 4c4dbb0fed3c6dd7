"""Sharding, expressed once: logical axis names (on every parameter, cache array and block-boundary activation)
-> mesh axes.

Mesh axes: `data` and `fsdp` split the batch (fsdp also splits the weights' embed dimension, gathered on
use), `tensor` splits attention heads, MLP and expert widths and the vocabulary, `expert` splits the
routed experts (and the batch outside the MoE: attention is data parallel across the expert axis).
`RULES` is the only place that says which logical axis goes where, and this module the only one that names a
mesh axis: the rest of the package asks for a logical axis (`mesh_axes("experts")` for the expert-parallel
collectives, `constrain(x, "activation_batch", ...)` at block boundaries). `use_rules` swaps the table for a
block of code (`ShardedLM(..., rules=)` traces under it), so changing one rule moves the parameters, the
activations and the collectives together.
`make_mesh` builds a mesh, and `param_shardings` / `cache_shardings` turn the annotations into NamedShardings,
refusing (with the parameter's name) any dimension that its mesh axes do not divide, and any split of a quantised
weight that would cut its scale blocks.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ling_jax.cache import KDAState, LingCache, MLAState, MTPCache, PagedMLAState
from ling_jax.quantized import QuantizedWeight, is_quantized

MESH_AXES = ("data", "fsdp", "tensor", "expert")
BATCH_AXES = ("data", "fsdp", "expert")

# logical axis -> mesh axes (a tuple: the dimension is split over their product); absent = replicated
RULES: dict[str, tuple[str, ...]] = {
    # activations at block boundaries (`constrain`): [batch, length, embed] hidden states, [..., vocab] logits
    "activation_batch": BATCH_AXES,
    "activation_length": (),
    "activation_embed": (),
    "activation_vocab": ("tensor",),
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
    # the VL vision tower and projector (ling_jax.vl.vision) run replicated: well under 1B parameters next to the
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

# the hidden state [B, T, D] between blocks, and the logits [B, T, V]
ACTIVATION_BTD = ("activation_batch", "activation_length", "activation_embed")
ACTIVATION_BTV = ("activation_batch", "activation_length", "activation_vocab")

Rules = Mapping[str, tuple[str, ...]]
_ACTIVE_RULES: contextvars.ContextVar[Rules | None] = contextvars.ContextVar("ling_jax_rules", default=None)


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
        raise ShardingError(
            f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, but {len(devices)} are available"
        )
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


def check_rules(rules: Rules) -> dict[str, tuple[str, ...]]:
    """`rules` as a dict, after checking that every entry is a tuple of known mesh axes, each at most once."""
    for logical, axes in rules.items():
        if not isinstance(axes, tuple) or len(set(axes)) != len(axes) or not set(axes) <= set(MESH_AXES):
            raise ShardingError(
                f"rule {logical!r}: expected a tuple of distinct mesh axes from {MESH_AXES}, got {axes!r}"
            )
    return dict(rules)


@contextlib.contextmanager
def use_rules(rules: Rules) -> Iterator[None]:
    """Within the block, `rules` replace RULES for every function here that is not given rules explicitly (and so
    for the model's activation constraints and its expert-parallel collectives). Rules are read while tracing: a
    jitted function keeps the rules it was first traced under."""
    token = _ACTIVE_RULES.set(check_rules(rules))
    try:
        yield
    finally:
        _ACTIVE_RULES.reset(token)


def current_rules() -> Rules:
    """The rules of the innermost `use_rules` block, else RULES."""
    active = _ACTIVE_RULES.get()
    return RULES if active is None else active


def mesh_axes_for(logical: str | None, rules: Rules | None = None) -> tuple[str, ...]:
    """The mesh axes a logical axis maps to (all of them, whatever the mesh)."""
    rules = current_rules() if rules is None else rules
    if logical is None:
        return ()
    if logical not in rules:
        raise ShardingError(f"logical axis {logical!r} has no rule; known: {sorted(rules)}")
    return rules[logical]


def mesh_axes(logical: str, mesh=None, *, rules: Rules | None = None) -> tuple[str, ...]:
    """The axes of `mesh` (default: the context mesh, also inside a shard_map) of size > 1 that `logical` is
    split over, in rule order: what a collective over that logical axis names (e.g. `mesh_axes("experts")`)."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    sizes = {} if mesh.empty else dict(mesh.shape)
    return tuple(axis for axis in mesh_axes_for(logical, rules) if sizes.get(axis, 1) > 1)


def axes_size(mesh, axes: Sequence[str]) -> int:
    """How many ways `axes` of `mesh` split a dimension."""
    return math.prod(mesh.shape[axis] for axis in axes)


def _spec_entry(axes: Sequence[str]):
    return tuple(axes) if len(axes) > 1 else (axes[0] if axes else None)


def activation_spec(
    logical: Sequence[str | None], shape: Sequence[int], mesh=None, *, rules: Rules | None = None
) -> PartitionSpec:
    """PartitionSpec for an activation of `shape` with these logical axes over `mesh` (default: the context mesh):
    each dimension over the mesh axes of its rule that still divide it, in rule order (so a batch of one stays
    whole instead of failing); a mesh axis taken by an earlier dimension is skipped."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if len(logical) != len(shape):
        raise ShardingError(f"logical axes {tuple(logical)} do not match an array of shape {tuple(shape)}")
    used: set[str] = set()
    spec = []
    for name, size in zip(logical, shape):
        axes, ways = [], 1
        for axis in mesh_axes(name, mesh, rules=rules):
            if axis not in used and size % (ways * mesh.shape[axis]) == 0:
                axes.append(axis)
                ways *= mesh.shape[axis]
        used.update(axes)
        spec.append(_spec_entry(axes))
    return PartitionSpec(*spec)


def constrain(x: jax.Array, *logical: str | None) -> jax.Array:
    """`x` pinned to the sharding its logical axes give on the context mesh (`jax.set_mesh`, under the current
    rules); `x` unchanged without a mesh, or inside a shard_map (where the mesh axes are manual)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AxisType.Manual in mesh.axis_types:
        return x
    return jax.lax.with_sharding_constraint(x, activation_spec(logical, x.shape, mesh))


def per_shard(fn, in_axes: Sequence[Sequence[str | None] | None], out_axes: Sequence[Sequence[str | None]]):
    """`fn` run by each device on its own shards of its arguments: a shard_map over the context mesh, for the
    kernels XLA cannot split (it would all-gather a Pallas call's sharded operands and run the call whole on
    every device). in_axes: one entry per positional argument, its logical axes (None: the same on every device);
    out_axes: the logical axes of each output leaf, in `jax.tree.leaves` order. Each dimension is split as
    `activation_spec` splits it, so arrays that share a logical axis and its size are split alike; `fn` must be
    independent along every axis it is split on. Without a mesh, or inside a shard_map: `fn` itself."""

    def run(*args):
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or AxisType.Manual in mesh.axis_types:
            return fn(*args)

        def spec(axes, shape):
            return PartitionSpec() if axes is None else activation_spec(axes, shape, mesh)

        out_shapes = jax.eval_shape(fn, *args)
        leaves, tree = jax.tree.flatten(out_shapes)
        if len(leaves) != len(out_axes):
            raise ShardingError(f"per_shard: {len(out_axes)} output axes given for {len(leaves)} outputs")
        in_specs = tuple(spec(axes, jnp.shape(x)) for axes, x in zip(in_axes, args, strict=True))
        out_specs = jax.tree.unflatten(tree, [spec(axes, leaf.shape) for axes, leaf in zip(out_axes, leaves)])
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)

    return run


def logical_to_spec(
    axes: Sequence[str | None],
    shape: Sequence[int],
    axis_sizes: Mapping[str, int],
    *,
    name: str,
    rules: Rules | None = None,
) -> PartitionSpec:
    """PartitionSpec for one array over a mesh of `axis_sizes` (mesh.shape); each mesh axis is used at most once
    (first dimension wins)."""
    used: set[str] = set()
    spec = []
    for logical, size in zip(axes, shape):
        axes_here = tuple(a for a in mesh_axes_for(logical, rules) if axis_sizes.get(a, 1) > 1 and a not in used)
        ways = math.prod(axis_sizes[a] for a in axes_here)
        if size % ways:
            raise ShardingError(
                f"{name}: dimension {logical!r} of size {size} is not divisible by mesh axes "
                f"{axes_here} ({ways} ways) in shape {tuple(shape)}"
            )
        used.update(axes_here)
        spec.append(_spec_entry(axes_here))
    return PartitionSpec(*spec)


def _path_name(path) -> str:
    return ".".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in path)


def _check_scale_blocks(name: str, weight: QuantizedWeight, spec: PartitionSpec, axis_sizes: Mapping[str, int]):
    """Refuse a split of a quantised weight's last two dimensions whose shards do not hold whole scale blocks."""
    for dim in (-2, -1):
        entry, size, block = spec[dim], weight.shape[dim], weight.scale_block[dim]
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        ways = math.prod(axis_sizes[a] for a in axes)
        if ways > 1 and (size // ways) % block:
            raise ShardingError(
                f"{name}: mesh axes {axes} split dimension {len(weight.shape) + dim} (size {size}) of this quantised "
                f"weight {ways} ways, {size // ways} per device, which cuts its {block}-element scale blocks; use a "
                "mesh whose shards hold whole blocks, or load the checkpoint with weights='bf16' (generate.py, "
                "ling-serve: --weights bf16)"
            )


def param_specs(state: nnx.State, axis_sizes: Mapping[str, int], rules: Rules | None = None) -> nnx.State:
    """PartitionSpec for every parameter of `state` (nnx.state(model)), from its logical axis annotations, for
    a mesh of `axis_sizes` (no devices needed: the converter plans for a mesh it does not run on). A quantised
    weight (`ling_jax.quantized`) gets one spec for its values and its scales (split alike), and a mesh whose
    shards would cut its scale blocks is refused."""

    def one(path, variable):
        axes = variable.get_metadata().get("out_sharding")
        if axes is None:
            raise ShardingError(f"{_path_name(path)} has no logical axis annotation")
        value = variable.get_value()
        spec = logical_to_spec(axes, value.shape, axis_sizes, name=_path_name(path), rules=rules)
        if not is_quantized(value):
            return variable.replace(spec)
        _check_scale_blocks(_path_name(path), value, spec, axis_sizes)
        return variable.replace(value.with_leaves(spec))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def param_shardings(state: nnx.State, mesh: Mesh, rules: Rules | None = None) -> nnx.State:
    """NamedSharding for every parameter of `state` (nnx.state(model)) over `mesh` (for a quantised weight, one
    for its values and one for its scales)."""

    def named(variable):
        value = variable.get_value()
        if isinstance(value, PartitionSpec):
            return variable.replace(NamedSharding(mesh, value))
        return variable.replace(value.with_leaves(NamedSharding(mesh, value.values)))

    return jax.tree.map(named, param_specs(state, mesh.shape, rules), is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules | None = None) -> nnx.Module:
    """Places every parameter of `model` on `mesh` according to the rules (in place); returns the model."""
    state = nnx.state(model)
    shardings = param_shardings(state, mesh, rules)
    nnx.update(model, jax.tree.map(jax.device_put, state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    return model


def batch_axes(mesh, batch: int, *, rules: Rules | None = None) -> tuple[str, ...]:
    """The mesh axes a dimension of `batch` rows (or tokens) is split over: those of the `activation_batch` rule
    (of size > 1) that still divide it."""
    entry = activation_spec(("activation_batch",), (batch,), mesh, rules=rules)[0]
    return () if entry is None else (entry,) if isinstance(entry, str) else entry


def batch_spec(mesh: Mesh, batch: int, *trailing, rules: Rules | None = None) -> PartitionSpec:
    """[B, ...] arrays: B over `batch_axes`, the trailing dimensions as given (PartitionSpec entries)."""
    return PartitionSpec(batch_axes(mesh, batch, rules=rules) or None, *trailing)


# per-sequence cache arrays: logical axes after the leading batch dimension
CACHE_AXES = {
    KDAState: {"conv_window": ("conv_taps", "conv_channels"), "recurrent_state": ("heads", "state_dim", "state_dim")},
    MLAState: {"latent": ("cache_length", "kv_latent")},  # the latent is shared by all heads: batch split only
}


def _layer_specs(state: KDAState | MLAState | PagedMLAState, mesh: Mesh, batch: int, name: str, rules: Rules | None):
    if isinstance(state, PagedMLAState):  # a pool every sequence reads: whole on every device
        return PagedMLAState(latent_pages=PartitionSpec())
    fields = {}
    for field, axes in CACHE_AXES[type(state)].items():
        shape = getattr(state, field).shape
        rest = logical_to_spec(axes, shape[1:], mesh.shape, name=f"{name}.{field}", rules=rules)
        fields[field] = batch_spec(mesh, batch, *rest, rules=rules)
    return type(state)(**fields)


def cache_shardings(cache: LingCache | MTPCache, mesh: Mesh, rules: Rules | None = None):
    """NamedShardings for a cache: batch over the batch axes that divide it, KDA states' heads over `tensor`
    (a paged cache's pages whole on every device, its page table split like the batch)."""
    batch = cache.lengths.shape[0]
    lengths = batch_spec(mesh, batch, rules=rules)
    if isinstance(cache, MTPCache):
        specs = MTPCache(layer=_layer_specs(cache.layer, mesh, batch, "mtp", rules), lengths=lengths)
    else:
        specs = LingCache(
            layers=tuple(_layer_specs(s, mesh, batch, f"layers.{i}", rules) for i, s in enumerate(cache.layers)),
            lengths=lengths,
            page_table=None if cache.page_table is None else batch_spec(mesh, batch, None, rules=rules),
        )
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
