"""Will a model fit before a byte of it is loaded? The cheap half of the memory plan (`memory_plan`): per-device
bytes of the parameters and the decode cache, exact, from the abstract model and the sharding rules on a mesh of
given axis sizes (an `AbstractMesh`: no devices, nothing compiled), against the device's usable memory.

`generate.py` runs `check_fit` before it loads anything and refuses a model that cannot fit with one line: the
figures, and a `--weights` or `--mesh` that would fit. It leaves out the temporaries of a step (the compiled
memory plan, `scripts/memory_plan.py`, has them), so a model it passes may still run out of memory by those.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from ling_jax.build import text_config_of
from ling_jax.cache import LingCache, MTPCache
from ling_jax.checkpoints.hf import BF16, STORED
from ling_jax.config import LingConfig
from ling_jax.generation.memory import format_bytes
from ling_jax.generation.memory_plan import Hardware, abstract_model, per_device_bytes
from ling_jax.sharding import MESH_AXES, ShardingError, cache_shardings, param_shardings
from ling_jax.vl.config import LingVLConfig

TENSOR_WAYS = (1, 2, 4, 8)  # tensor-parallel sizes tried when looking for a mesh that fits
MAX_DEVICES = 1 << 14


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Per-device bytes that are resident for the whole run."""

    param_bytes: int
    cache_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.cache_bytes


def abstract_mesh(mesh_shape: Mapping[str, int]) -> AbstractMesh:
    """A mesh of these axis sizes (the others 1), without devices."""
    sizes = tuple(mesh_shape.get(axis, 1) for axis in MESH_AXES)
    return AbstractMesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


class FitCheck:
    """The abstract model and cache of one generation run, priced on any mesh and in either weight format."""

    def __init__(self, config: LingConfig | LingVLConfig, *, dtype, batch: int, context: int, mtp: bool):
        self.config, self.dtype = config, dtype
        text = text_config_of(config)
        kinds = (LingCache, MTPCache) if mtp else (LingCache,)
        self.caches = jax.eval_shape(lambda: [kind.create(text, batch, context, dtype) for kind in kinds])
        self._states: dict[str, nnx.State] = {}

    def _state(self, weights: str) -> nnx.State:
        if weights not in self._states:
            self._states[weights] = nnx.state(abstract_model(self.config, weights=weights, dtype=self.dtype))
        return self._states[weights]

    def footprint(self, mesh_shape: Mapping[str, int], weights: str) -> Footprint:
        """Per-device bytes on a mesh of `mesh_shape`; ShardingError if the model does not divide over it."""
        mesh, state = abstract_mesh(mesh_shape), self._state(weights)
        cache_bytes = sum(per_device_bytes(cache, cache_shardings(cache, mesh)) for cache in self.caches)
        return Footprint(per_device_bytes(state, param_shardings(state, mesh)), cache_bytes)

    def fitting(self, mesh_shape: Mapping[str, int], weights: str, usable: int) -> Footprint | None:
        try:
            footprint = self.footprint(mesh_shape, weights)
        except ShardingError:
            return None
        return footprint if footprint.total_bytes <= usable else None


def _mesh_text(mesh_shape: Mapping[str, int]) -> str:
    return ",".join(f"{axis}={size}" for axis, size in mesh_shape.items() if size > 1) or "one device"


def _meshes(devices: int):
    """Meshes of `devices` devices: experts split, and experts and tensors split."""
    for tensor in TENSOR_WAYS:
        if devices % tensor == 0:
            yield {"tensor": tensor, "expert": devices // tensor} if tensor > 1 else {"expert": devices}


def _way_to_fit(check: FitCheck, mesh_shape, weights: str, usable: int, devices: int, quantized: bool) -> str:
    """What would fit: the stored weights on this mesh, else a mesh over this process's devices, else the
    smallest mesh (powers of two) that would."""
    formats = [weights] + ([STORED] if weights == BF16 and quantized else [])
    if len(formats) > 1 and (footprint := check.fitting(mesh_shape, STORED, usable)):
        return f"--weights stored fits ({format_bytes(footprint.total_bytes)} per device)"
    count = devices
    while count <= MAX_DEVICES:
        for shape in _meshes(count):
            for fmt in formats:
                if footprint := check.fitting(shape, fmt, usable):
                    flags = f"--mesh {_mesh_text(shape)}" + (" --weights stored" if fmt != weights else "")
                    more = "" if count == devices else f" ({count} devices; this process has {devices})"
                    return f"{flags} would fit{more}: {format_bytes(footprint.total_bytes)} per device"
        count *= 2
    return f"no mesh of up to {MAX_DEVICES} devices fits"


def check_fit(
    config: LingConfig | LingVLConfig,
    mesh_shape: Mapping[str, int],
    hardware: Hardware,
    *,
    weights: str,
    dtype=jnp.bfloat16,
    batch: int,
    context: int,
    mtp: bool = False,
    devices: int = 1,
    quantized: bool = True,
    skip_flag: str | None = "--no-memory-check",
) -> str | None:
    """None when the parameters and the decode cache (the MTP draft cache too with `mtp`) fit `hardware`'s usable
    memory per device on a mesh of `mesh_shape` with `weights`; else one line: the per-device figures and a
    `--weights` or `--mesh` that would fit (over `devices` devices, or the fewest more). quantized: whether
    weights="stored" keeps FP8 (the checkpoint is quantised, or a preset: published FP8); otherwise stored is
    dense too. skip_flag: the caller's flag that skips the check, named at the end of the line (None: none).
    ShardingError if the model does not divide over the mesh."""
    check = FitCheck(config, dtype=dtype, batch=batch, context=context, mtp=mtp)
    priced = weights if quantized else BF16
    footprint = check.footprint(mesh_shape, priced)
    usable = hardware.usable_bytes
    if footprint.total_bytes <= usable:
        return None
    way = _way_to_fit(check, mesh_shape, priced, usable, devices, quantized)
    return (
        f"does not fit: {format_bytes(footprint.param_bytes)} of parameters + {format_bytes(footprint.cache_bytes)} "
        f"of cache per device (mesh {_mesh_text(mesh_shape)}, --weights {weights}, batch {batch}, context {context:,}) "
        f"exceed the {format_bytes(usable)} usable on {hardware.name}; {way}"
        + (f" ({skip_flag} skips this check)" if skip_flag else "")
    )


__all__ = ["FitCheck", "Footprint", "abstract_mesh", "check_fit"]
