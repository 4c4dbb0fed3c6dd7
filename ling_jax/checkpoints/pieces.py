"""Global arrays built from per-device pieces: each process reads the slices its own devices hold, once per
distinct slice, and never the whole array (the sharded checkpoint loaders)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from ling_jax.checkpoints.safetensors_io import Index


def one_device_sharding() -> jax.sharding.Sharding:
    """Where a loader without a mesh puts the model: this process's first device."""
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def assemble(
    shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding, read: Callable[[Index], np.ndarray]
) -> jax.Array:
    """The global array of `shape` and `dtype` placed with `sharding`, from `read(index)`: the host data of the slice
    `index` (a tuple of slices, one per dimension), asked for once per distinct slice this process's devices hold
    (devices holding the same slice share the read), each copied to its devices before the next is read."""
    dtype = np.dtype(dtype)
    indices = sharding.addressable_devices_indices_map(shape)  # in the sharding's device order
    devices_of: dict[tuple[tuple[int, int], ...], list[jax.Device]] = {}  # (start, stop) per dimension -> devices
    for device, index in indices.items():
        bounds = tuple(entry.indices(size)[:2] for entry, size in zip(index, shape))
        devices_of.setdefault(bounds, []).append(device)
    pieces = {}
    for bounds, devices in devices_of.items():
        piece_shape = tuple(stop - start for start, stop in bounds)
        host = np.asarray(read(tuple(slice(*b) for b in bounds))).astype(dtype, copy=False).reshape(piece_shape)
        pieces.update((device, jax.device_put(host, device)) for device in devices)
    return jax.make_array_from_single_device_arrays(shape, sharding, [pieces[device] for device in indices])
