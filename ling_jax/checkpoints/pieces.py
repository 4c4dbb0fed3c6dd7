"""Global arrays built from per-device pieces: each process reads the slices its own devices hold, once per
distinct slice, and never the whole array (the sharded checkpoint loaders); many arrays at once under a bound on the
host bytes in flight (`load_all`)."""

from __future__ import annotations

import math
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import jax
import numpy as np

from ling_jax.checkpoints.safetensors_io import Index

T = TypeVar("T")
LOAD_WORKERS = min(8, os.cpu_count() or 1)  # reading threads: pread, numpy copies and device_put release the GIL
LOAD_BUFFER_BYTES = 1 << 30  # host bytes read and not yet released at once (a larger array goes alone)
HOST_ALIGNMENT = 64  # bytes: jax's CPU client uses a numpy array aligned so in place, without copying it
MAPPED_BYTES = 1 << 20  # host buffers this large are mapped on their own (`host_buffer`)


def one_device_sharding() -> jax.sharding.Sharding:
    """Where a loader without a mesh puts the model: this process's first device."""
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def host_buffer(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised host array of `shape` and `dtype` starting on a HOST_ALIGNMENT boundary. One of at least
    MAPPED_BYTES is an anonymous mapping of its own with every page faulted in by the one mmap call (MAP_POPULATE)
    and no transparent huge pages (numpy asks for those past 4 MB; their first touch cost 3-10x as much on the
    2-core VM; where MAP_POPULATE does not exist, as on macOS, the pages fault in as they are read); smaller ones
    come from the heap."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= MAPPED_BYTES:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)  # Linux only
        return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype).reshape(shape)
    raw = np.empty(nbytes + HOST_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % HOST_ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def assemble(
    shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding, read: Callable[[Index, np.ndarray], None]
) -> jax.Array:
    """The global array of `shape` and `dtype` placed with `sharding`, from `read(index, out)`, which fills `out`
    (a `host_buffer` of the slice's shape and `dtype`) with the slice `index` (a tuple of slices, one per
    dimension): called once per distinct slice this process's devices hold (devices holding the same slice share
    the read), each put on its devices before the next is read; on CPU devices jax keeps `out` as the device buffer
    (no copy)."""
    indices = sharding.addressable_devices_indices_map(shape)  # in the sharding's device order
    pieces = {}
    for bounds, devices in _devices_of_slices(shape, sharding).items():
        host = host_buffer(tuple(stop - start for start, stop in bounds), dtype)
        read(tuple(slice(*b) for b in bounds), host)
        pieces.update((device, jax.device_put(host, device)) for device in devices)
    return jax.make_array_from_single_device_arrays(shape, sharding, [pieces[device] for device in indices])


def host_bytes(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding) -> int:
    """The bytes `assemble` reads for this process: one copy of each distinct slice its devices hold."""
    sizes = (math.prod(stop - start for start, stop in bounds) for bounds in _devices_of_slices(shape, sharding))
    return sum(sizes) * np.dtype(dtype).itemsize


def _devices_of_slices(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> dict[tuple, list[jax.Device]]:
    """(start, stop) per dimension of each distinct slice this process's devices hold -> the devices holding it."""
    devices_of: dict[tuple[tuple[int, int], ...], list[jax.Device]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        bounds = tuple(entry.indices(size)[:2] for entry, size in zip(index, shape))
        devices_of.setdefault(bounds, []).append(device)
    return devices_of


class _HostBudget:
    """Host bytes in flight: `take(n)` waits until n more fit under `limit` (or nothing is in flight), and raises
    the first error a job reported (`fail`) instead of waiting on."""

    def __init__(self, limit: int):
        self.limit, self.held, self.error = limit, 0, None
        self.changed = threading.Condition()

    def take(self, n: int) -> None:
        with self.changed:
            self.changed.wait_for(lambda: self.error or not self.held or self.held + n <= self.limit)
            if self.error:
                raise self.error
            self.held += n

    def give(self, n: int, error: BaseException | None = None) -> None:
        with self.changed:
            self.held -= n
            self.error = self.error or error
            self.changed.notify_all()


def load_all(
    jobs: Sequence[Callable[[], T]],
    nbytes: Sequence[int],
    *,
    workers: int = LOAD_WORKERS,
    buffer_bytes: int = LOAD_BUFFER_BYTES,
    done: Callable[[int], None] = lambda n: None,
) -> list[T]:
    """Each of `jobs` run in a pool of `workers` threads, in order, started while the host bytes of the running
    ones (`nbytes`, one per job) stay within `buffer_bytes` (a larger job runs alone); done(n) after each job of n
    bytes. The first failure stops the start of further jobs and is raised."""
    budget = _HostBudget(buffer_bytes)

    def run(job: Callable[[], T], n: int) -> T:
        try:
            value = job()
        except BaseException as e:
            budget.give(n, e)
            raise
        budget.give(n)
        done(n)
        return value

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = []
        for job, n in zip(jobs, nbytes, strict=True):
            budget.take(n)
            futures.append(pool.submit(run, job, n))
        return [future.result() for future in futures]
