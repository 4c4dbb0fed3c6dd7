"""Differences between the jax versions ling-jax runs on (0.10.2 on CPU, 0.11.2 on GPU), and between the
orbax-checkpoint versions it reads checkpoints with, in one place."""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import math
import os
import re
import warnings

import numpy as np

# XLA:CPU workaround, jax/jaxlib 0.10.2 (also 0.11.2): the YNNPACK fusions (`__ynn_fusion`) miscompile some
# programs into reads of uninitialised memory. Under jit, `jnp.sum(a, -1) @ c + x @ jnp.zeros((128, 128))` for
# a [32, 32, 128], c and x [32, 128] returns garbage or NaN (eager is right). The chunked KDA reference at
# head_dim 128 with a zero initial state made inside the jit (any cache-less forward) has that shape of
# program: jitted decoder layers came out ~100% off or NaN. Turning the YNNPACK fusions off (a CPU-only XLA
# flag, read when jax creates its backends, so before any computation) fixes it; an explicit setting of the
# flag in XLA_FLAGS is left alone. Regression test: tests/test_xla_cpu_workaround.py. Imported by
# `pallas_kernels/__init__.py`.
_YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
_YNN_AFFECTED = ((0, 10, 2), (0, 12, 0))  # jaxlib versions known to have the flag (older ones reject it)


def _jaxlib_version() -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in re.findall(r"\d+", importlib.metadata.version("jaxlib"))[:3])
    except importlib.metadata.PackageNotFoundError:
        return ()


def _disable_ynn_fusions() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if _YNN_FLAG in flags or not _YNN_AFFECTED[0] <= _jaxlib_version() < _YNN_AFFECTED[1]:
        return
    os.environ["XLA_FLAGS"] = f"{flags} {_YNN_FLAG}=".strip()
    try:
        from jax._src.xla_bridge import backends_are_initialized
    except ImportError:
        return
    if backends_are_initialized():
        warnings.warn(
            f"jax's backends were created before pallas_kernels / ling_jax was imported, so {_YNN_FLAG}= "
            "came too late: jitted CPU programs (the chunked KDA at head_dim 128) can compute garbage "
            f"on this jaxlib; import ling_jax first or set XLA_FLAGS='{_YNN_FLAG}='",
            stacklevel=2,
        )


_disable_ynn_fusions()

# XLA:CPU's fusion emitters (its default) against its older elemental emitters, jaxlib 0.10.2: the test suite's
# subprocesses (multi-process jobs, CLI and training runs) took 20-40% less CPU time with the older ones, the same
# bits out on the demo model; in process, files of bf16 or long-running programs took up to 2.5x more (their code
# is slower). The tests' helpers add the flag to those subprocesses' XLA_FLAGS where the jaxlib is one it was
# measured on (XLA aborts on a flag it does not know).
_ELEMENTAL_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"
_ELEMENTAL_EMITTERS_MEASURED = ((0, 10, 2), (0, 11, 0))


def fast_cpu_compile_flags() -> list[str]:
    """XLA_FLAGS entries that make XLA:CPU compile faster on this jaxlib (none where not measured)."""
    low, high = _ELEMENTAL_EMITTERS_MEASURED
    return [_ELEMENTAL_EMITTERS_FLAG] if low <= _jaxlib_version() < high else []


def mosaic_gpu_interpret(enabled: bool):
    """The `interpret` argument of `plgpu.kernel` (Pallas Mosaic GPU) that runs a kernel on the CPU with
    simulated shared memory, TMA, barriers and wgmma (jax >= 0.10.2, where the class is not public yet), or
    None for a compiled kernel."""
    if not enabled:
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


# --- orbax-checkpoint ------------------------------------------------------------------------------------------
# ling-convert writes its tensorstore specs itself (convert/store.py: orbax's spec builders are internal and
# changed across releases); what remains of orbax is its public checkpointer API, which differs here.


def checkpoint_tree_metadata(path: str):
    """The tree metadata (`.tree`: the nested dict of `ArrayMetadata`) of the Orbax PyTree checkpoint at `path`,
    or None where it has none. orbax-checkpoint >= 0.11.22 returns it from `StandardCheckpointer.metadata` inside
    a `StepMetadata`, older releases bare. orbax is imported here, on first use: `import ling_jax` stays cheap."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        metadata = checkpointer.metadata(path)
    return metadata.item_metadata if isinstance(metadata, ocp.metadata.StepMetadata) else metadata


# Pallas Triton workaround, jax 0.10.2 (the GPU's 0.11.2 too): the Triton lowering gives a ref int64 element
# offsets only when it holds more than 2^32 *bytes* (`_compute_offsets_from_indices`), so a one-byte operand of
# 2^31 to 2^32 elements (Ling flash's block-FP8 expert stack [512, 1280, 4096]: 2.7e9) is indexed with int32
# element offsets that wrap past 2^31 (wrong results, or an illegal address, on an H200). `widen_triton_offsets`
# wraps that function so the choice counts elements (an operand past 2^31 of them is indexed as a four-byte one
# of its shape would be: int64); offsets stay in elements, so nothing else changes. Regression tests:
# tests/kernels/test_moe_quantized.py (`int32_offsets_into_large_operands` on the lowered kernels).
_INT32_OFFSET_ELEMENTS = 2**31


@functools.cache
def widen_triton_offsets() -> bool:
    """Apply the workaround above (once); False where the lowering is not the one it patches (then the MoE
    kernels take such FP8 stacks as uint16 pairs, `weight_tiles.pairs_needed`)."""
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:
        return False
    original = getattr(lowering, "_compute_offsets_from_indices", None)
    block_info_type = getattr(lowering, "BlockInfo", None)
    if original is None or not dataclasses.is_dataclass(block_info_type):
        return False
    if getattr(original, "widened", False):
        return True

    @functools.wraps(original)
    def by_elements(block_info, nd_indexer):
        full = block_info.full_shape_dtype
        if math.prod(full.shape) > _INT32_OFFSET_ELEMENTS and np.dtype(full.dtype).itemsize < 4:
            block_info = dataclasses.replace(block_info, full_shape_dtype=full.update(dtype=np.dtype(np.int32)))
        return original(block_info, nd_indexer)

    by_elements.widened = True
    lowering._compute_offsets_from_indices = by_elements
    return True


def lower_for_cuda(fn, *abstract_args):
    """jax.jit(fn) lowered for CUDA from any machine: jax >= 0.11 asks for the target GPU when none is attached, so
    an abstract H200 is supplied through an abstract mesh (older jax ignores it). fn may be a `jax.stages.Traced`
    instead (traced outside the mesh, where the model's norms run as their kernels), lowered as it is."""
    import jax

    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=h200)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = fn if isinstance(fn, jax.stages.Traced) else jax.jit(fn).trace(*abstract_args)
        return traced.lower(lowering_platforms=("cuda",))
