"""Assertions about where a model's arrays live on a mesh."""

from __future__ import annotations

import math

import jax
from flax import nnx


def leaves(model) -> dict[str, jax.Array]:
    """Every array of the model's state, by its path."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in flat}


def assert_each_device_holds_its_fraction(model, mesh) -> None:
    """Every array: one piece on each of this process's devices of `mesh`, of its global shape divided by the mesh
    axes its spec names (no device holds more than its share)."""
    for name, leaf in leaves(model).items():
        spec = leaf.sharding.spec
        ways = [
            math.prod(mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else entry or ()))
            for entry in (*spec, *(None,) * (leaf.ndim - len(spec)))
        ]
        expected = tuple(size // n for size, n in zip(leaf.shape, ways))
        assert len(leaf.addressable_shards) == len(mesh.local_devices), name
        assert {shard.data.shape for shard in leaf.addressable_shards} == {expected}, name
