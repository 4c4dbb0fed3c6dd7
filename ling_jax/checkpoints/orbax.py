"""Restore `LingForCausalLM` from an Orbax checkpoint written by ling-convert (`convert/`), straight into the
requested shardings.

Layout (orbax-checkpoint's PyTree format: OCDBT database of zarr arrays, `_METADATA`): one array per NNX
parameter, named by its flat path joined with dots (`model.layers.3.attention.kv_b_proj.weight`, routed experts
stacked as `model.layers.1.mlp.experts.up_proj` [E, I, D], the MTP layer under `mtp.`), plus `config.json` and
`ling_convert.json` (`StoredLayout`). A parameter kept in FP8 is stored as float8 with a `<name>_scale_inv`
sibling of one float32 scale per block (the scale multiplies, as in HF checkpoints); it is restored as it is
stored (`weights="stored"`: a `ling_jax.quantized.BlockFP8Weight`, values and scales sharded alike) or
dequantised on the device after the restore (`weights="bf16"`).

A damaged directory (an unreadable `_METADATA`, a missing or truncated data file, a broken `ling_convert.json`) and
a parameter holding NaN or Inf raise ValueError naming the file or parameter.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from ling_jax.build import abstract_model, load_model_config
from ling_jax.checkpoints.finite_check import all_finite_numpy
from ling_jax.checkpoints.hf import SCALE_SUFFIX, STORED, check_weights
from ling_jax.checkpoints.pieces import one_device_sharding
from ling_jax.model import LingForCausalLM
from ling_jax.policy import ExecutionPolicy
from ling_jax.progress import progress_bar
from ling_jax.quantized import BlockFP8Weight, check_activation_dtype, dequantize_blocks, is_quantized
from ling_jax.sharding import param_shardings
from pallas_kernels.compat import checkpoint_tree_metadata

LAYOUT_FILE = "ling_convert.json"
LAYOUT_FORMAT = "ling-convert/1"
METADATA_FILE = "_METADATA"  # orbax's tree of the stored arrays


def param_name(path: tuple) -> str:
    """The stored array name of the parameter at an NNX flat-state path."""
    return ".".join(str(key) for key in path)


def scale_name(name: str) -> str:
    """The stored name of the block scales of the FP8 parameter stored as `name`."""
    return name + SCALE_SUFFIX


def scale_path(path: tuple) -> tuple:
    return (*path[:-1], path[-1] + SCALE_SUFFIX)


@dataclasses.dataclass(frozen=True)
class StoredLayout:
    """What `ling_convert.json` records: the dtype dense parameters were written in, and for each parameter
    kept quantised the (rows, cols) block that one entry of its scale array covers."""

    compute_dtype: str
    scale_blocks: dict[str, tuple[int, int]]
    mesh: dict[str, int] | None = None  # the mesh (axis sizes) the chunks were aligned to (`ling-convert --mesh`)

    def write(self, directory: str) -> None:
        body = {
            "format": LAYOUT_FORMAT,
            "compute_dtype": self.compute_dtype,
            "scale_blocks": {name: list(block) for name, block in sorted(self.scale_blocks.items())},
            "mesh": self.mesh,
        }
        with open(os.path.join(directory, LAYOUT_FILE), "w") as f:
            json.dump(body, f)

    @classmethod
    def read(cls, directory: str) -> StoredLayout:
        file = os.path.join(directory, LAYOUT_FILE)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{directory}: no {LAYOUT_FILE}; not a checkpoint written by ling-convert")
        try:
            with open(file, "rb") as f:
                body = json.loads(f.read().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{file}: not valid JSON ({e}); convert the checkpoint again") from e
        if not isinstance(body, dict) or body.get("format") != LAYOUT_FORMAT:
            found = body.get("format") if isinstance(body, dict) else body
            raise ValueError(f"{file}: format {found!r}, expected {LAYOUT_FORMAT!r}")
        compute_dtype, blocks, mesh = body.get("compute_dtype"), body.get("scale_blocks"), body.get("mesh")
        if not _is_float_dtype(compute_dtype):
            raise ValueError(f"{file}: 'compute_dtype' is {compute_dtype!r}, expected a float dtype ('bfloat16')")
        if not isinstance(blocks, dict) or not all(_is_block(block) for block in blocks.values()):
            raise ValueError(f"{file}: 'scale_blocks' must map parameter names to [rows, cols] block sizes")
        if mesh is not None and not (isinstance(mesh, dict) and all(isinstance(n, int) for n in mesh.values())):
            raise ValueError(f"{file}: 'mesh' must be null or map axis names to sizes, got {mesh!r}")
        return cls(compute_dtype, {name: tuple(block) for name, block in blocks.items()}, mesh)


def _is_float_dtype(name) -> bool:
    try:
        return isinstance(name, str) and jnp.issubdtype(jnp.dtype(name), jnp.floating)
    except TypeError:
        return False


def _is_block(block) -> bool:
    return isinstance(block, list) and len(block) == 2 and all(isinstance(n, int) and n > 0 for n in block)


def _flatten(tree: dict, prefix: tuple = ()) -> dict[tuple, object]:
    flat = {}
    for key, child in tree.items():
        if isinstance(child, dict):
            flat.update(_flatten(child, (*prefix, key)))
        else:
            flat[(*prefix, key)] = child
    return flat


def _nested(flat: dict[tuple, object]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _stored_arrays(path: str) -> dict[str, ocp.metadata.ArrayMetadata]:
    """Stored array name -> its metadata (shape, dtype), from the checkpoint's `_METADATA`."""
    if not os.path.isfile(os.path.join(path, METADATA_FILE)):
        raise ValueError(
            f"{path}: damaged checkpoint: {METADATA_FILE} (the index of the stored arrays) is missing; "
            "convert the checkpoint again"
        )
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)  # orbax logs a warning of its own where it returns no metadata
    try:
        item = checkpoint_tree_metadata(path)
    except Exception as e:  # orbax raises whatever its parsers meet
        raise ValueError(f"{path}: damaged checkpoint: its array metadata cannot be read ({_root_cause(e)})") from e
    finally:
        absl_logger.setLevel(level)
    if item is None:
        raise ValueError(
            f"{path}: damaged checkpoint: its array metadata ({METADATA_FILE}, manifest.ocdbt) cannot be "
            "read; convert the checkpoint again"
        )
    return {param_name(keys): metadata for keys, metadata in _flatten(item.tree).items()}


def _root_cause(error: BaseException) -> str:
    """The innermost error's first line (orbax wraps tensorstore's in pages of spec)."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


_all_finite = jax.jit(lambda value: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(value)])))


def _finite_on_host(value) -> bool:
    arrays = [shard.data for leaf in jax.tree.leaves(value) for shard in leaf.addressable_shards]
    return all(all_finite_numpy(np.asarray(a)) for a in arrays if jnp.issubdtype(a.dtype, jnp.floating))


def _devices(value) -> set:
    return {device for leaf in jax.tree.leaves(value) for device in leaf.devices()}


def _refuse_non_finite(path: str, loaded: list[tuple[tuple, object]]) -> None:
    """One fused reduction per parameter on its devices, one host transfer for all. On CPU devices (host memory:
    nothing to transfer) each shard is read in place instead: a jitted reduction over arrays Orbax has just
    restored onto an 8-device CPU mesh aborted the process now and then (XLA:CPU, jax 0.10.2; seen in
    tests/convert/test_convert_mesh.py under pytest-xdist, at either optimisation level)."""
    if all(device.platform == "cpu" for _, v in loaded for device in _devices(v.get_value())):
        finite = [_finite_on_host(variable.get_value()) for _, variable in loaded]
    else:
        finite = jax.device_get([_all_finite(variable.get_value()) for _, variable in loaded])
    for (p, _), ok in zip(loaded, finite):
        if not ok:
            raise ValueError(
                f"{path}: parameter '{param_name(p)}' holds NaN or Inf values: the checkpoint is "
                "damaged (or was converted from a damaged one)"
            )


def _restore_group(path: tuple) -> tuple:
    """Arrays restored together (one step of the progress bar): a decoder layer, else a top-level module."""
    return path[:3] if len(path) > 3 and path[1] == "layers" else path[:1]


def _restore(path: str, target: dict[tuple, jax.ShapeDtypeStruct], progress: bool) -> dict[tuple, jax.Array]:
    """Restore `target`'s arrays a group at a time (Orbax partial restores), with a progress bar."""
    groups: dict[tuple, dict[tuple, jax.ShapeDtypeStruct]] = {}
    for p, struct in target.items():
        groups.setdefault(_restore_group(p), {})[p] = struct
    restored = {}
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        for group in progress_bar(groups.values(), desc="loading checkpoint", unit="group", enabled=progress):
            # asked for by the keys as stored, all strings (layer indices too): orbax 0.11.20 matches keys exactly
            paths = {tuple(str(key) for key in p): p for p in group}
            tree = _nested({keys: group[p] for keys, p in paths.items()})
            args = ocp.args.PyTreeRestore(
                item=tree, restore_args=ocp.checkpoint_utils.construct_restore_args(tree), partial_restore=True
            )
            try:
                values = _flatten(checkpointer.restore(path, args=args))
            except Exception as e:  # tensorstore's errors arrive wrapped in a bare Exception
                raise ValueError(f"{path}: restoring failed, the checkpoint looks damaged: {_root_cause(e)}") from e
            restored.update({paths[keys]: value for keys, value in values.items()})
    return restored


def load_checkpoint(
    path: str | os.PathLike,
    *,
    mesh: jax.sharding.Mesh | None = None,
    dtype=None,
    weights: str = STORED,
    progress: bool = False,
    policy: ExecutionPolicy | None = None,
) -> LingForCausalLM:
    """Restore a ling-convert checkpoint as `LingForCausalLM` (`LingVLForConditionalGeneration` for a VL one).

    Every parameter is restored straight into its target sharding (from the logical axis rules of
    `ling_jax.sharding` over `mesh`, or on this process's first device without one) from an abstract model
    (`nnx.eval_shape`): arrays go from storage to their devices one by one, and the model is never built on the
    host first.
    `dtype` is the model (activation) dtype (default: the dtype the checkpoint was converted to; FP8
    checkpoints default to bfloat16; an FP8 dtype is refused); A_log, dt_bias, conv weights and the expert bias
    stay float32. weights: "stored" (the default) restores FP8 parameters as stored, values and block scales
    (`BlockFP8Weight`, sharded alike; a mesh whose shards would cut a block is refused), wherever the model
    takes a quantised weight (elsewhere they are dequantised); "bf16" dequantises them to `dtype` on the
    device, one at a time. A parameter whose stored shape disagrees with config.json raises ValueError naming
    it. progress: a tqdm bar on stderr, one step per decoder layer (restored together). policy: how
    the model runs, as for `LingForCausalLM` (None: `ExecutionPolicy()`).
    """
    path = os.path.abspath(os.fspath(path))
    check_weights(weights, "load_checkpoint")
    if dtype is not None:
        check_activation_dtype(dtype, "load_checkpoint")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    layout = StoredLayout.read(path)
    config = load_model_config(path)
    dtype = jnp.dtype(dtype or layout.compute_dtype)
    abstract = abstract_model(config, dtype=dtype, policy=policy)
    graphdef, abstract_state = nnx.split(abstract)
    stored = _stored_arrays(path)
    flat = [(p, _as_stored(path, p, v, stored, layout, weights)) for p, v in nnx.to_flat_state(abstract_state)]
    if mesh is None:
        one_device = one_device_sharding()  # this process's: jax.devices()[0] is process 0's
        shardings = {p: jax.tree.map(lambda _: one_device, v.get_value()) for p, v in flat}
        small = one_device
    else:
        specs = param_shardings(nnx.from_flat_state(flat), mesh)
        shardings = {p: v.get_value() for p, v in nnx.to_flat_state(specs)}
        small = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())  # scales of dequantised weights
    target = {}
    for p, variable in flat:
        name, want = param_name(p), variable.get_value()
        if is_quantized(want):
            target[p] = jax.ShapeDtypeStruct(want.values.shape, want.values.dtype, sharding=shardings[p].values)
            target[scale_path(p)] = jax.ShapeDtypeStruct(
                want.scales.shape, want.scales.dtype, sharding=shardings[p].scales
            )
        elif name in layout.scale_blocks:
            have, scale = stored[name], stored[scale_name(name)]
            target[p] = jax.ShapeDtypeStruct(have.shape, have.dtype, sharding=shardings[p])
            target[scale_path(p)] = jax.ShapeDtypeStruct(scale.shape, scale.dtype, sharding=small)
        else:
            target[p] = jax.ShapeDtypeStruct(want.shape, want.dtype, sharding=shardings[p])
    restored = _restore(path, target, progress)
    loaded = []
    for p, variable in flat:
        value, want = restored.pop(p), variable.get_value()
        block = layout.scale_blocks.get(param_name(p))
        if is_quantized(want):
            value = BlockFP8Weight(value, restored.pop(scale_path(p)), want.block)
        elif block is not None:  # dropping each FP8 array once dequantised bounds the peak by the dense model
            dequantize = jax.jit(dequantize_blocks, static_argnames=("block", "dtype"), out_shardings=shardings[p])
            value = dequantize(value, restored.pop(scale_path(p)), block=block, dtype=want.dtype)
        loaded.append((p, variable.replace(value)))
    _refuse_non_finite(path, loaded)
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _as_stored(path: str, p: tuple, variable: nnx.Variable, stored: dict, layout: StoredLayout, weights: str):
    """The abstract parameter `variable` checked against what the checkpoint stores for it; an abstract
    `BlockFP8Weight` where the parameter is restored quantised."""
    name, want = param_name(p), variable.get_value()
    if name not in stored:
        raise ValueError(f"{path}: parameter '{name}' is missing from the checkpoint")
    have = stored[name]
    if tuple(have.shape) != tuple(want.shape):
        raise ValueError(
            f"{path}: parameter '{name}' has shape {list(have.shape)}, expected {list(want.shape)} from config.json"
        )
    if name not in layout.scale_blocks:
        return variable
    if scale_name(name) not in stored:
        raise ValueError(f"{path}: FP8 parameter '{name}' has no '{scale_name(name)}' beside it")
    scale, block = stored[scale_name(name)], layout.scale_blocks[name]
    blocks = (*have.shape[:-2], *(-(-size // side) for size, side in zip(have.shape[-2:], block)))
    if tuple(scale.shape) != blocks:
        raise ValueError(
            f"{path}: '{scale_name(name)}' has shape {list(scale.shape)}, expected {list(blocks)} for the "
            f"{list(have.shape)} parameter '{name}' in {block[0]}x{block[1]} blocks; convert the checkpoint again"
        )
    if weights != STORED or not variable.get_metadata().get("quantizable"):
        return variable
    values = jax.ShapeDtypeStruct(tuple(have.shape), have.dtype)
    scales = jax.ShapeDtypeStruct(tuple(scale.shape), scale.dtype)
    return variable.replace(BlockFP8Weight(values, scales, block))
