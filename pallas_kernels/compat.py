"""Differences between the jax versions ling-jax runs on (0.10.2 on CPU, 0.11.2 on GPU), and between the
orbax-checkpoint versions it reads checkpoints with, in one place."""

from __future__ import annotations

import importlib.metadata
import os
import re
import warnings

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
