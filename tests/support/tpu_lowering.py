"""Lowering Pallas TPU kernels from a machine without a TPU, for a chosen TPU generation."""

from __future__ import annotations

import contextlib

import jax

# jax.Device.device_kind of the TPU generations without an FP8 matrix unit, which the weight-only kernels target.
TPU_KINDS = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite"}


@contextlib.contextmanager
def abstract_tpu(device_kind: str):
    """An abstract one-chip TPU mesh: Pallas's lowering asks it (`pltpu.get_tpu_info()`) for the chip."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def lower_for_tpu(fn, *abstract_args, device_kind: str):
    """jax.jit(fn) traced on abstract arguments and lowered for TPU (Mosaic custom calls) on the given chip."""
    with abstract_tpu(device_kind):
        return jax.jit(fn).trace(*abstract_args).lower(lowering_platforms=("tpu",))


def calls_a_kernel(fn, *args) -> bool:
    """Whether fn(*args) traces to a Pallas kernel (without running it)."""
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))
