"""Which implementation a kernel entry point runs: one rule for every op in pallas_kernels."""

from __future__ import annotations

import jax

BACKENDS = ("auto", "reference", "pallas_gpu", "pallas_tpu", "interpret", "interpret_gpu", "interpret_tpu")
KERNEL_TARGET = {"pallas_gpu": "gpu", "interpret_gpu": "gpu", "pallas_tpu": "tpu", "interpret_tpu": "tpu",
                 "interpret": "tpu"}


def resolve_backend(backend: str) -> str:
    """"auto" -> the Pallas kernel of jax.default_backend() (GPU or TPU), or the jnp reference on a CPU.

    "interpret_gpu" / "interpret_tpu" run that kernel in Pallas interpret mode on any platform (for CPU
    tests); "interpret" means "interpret_tpu".
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(jax.default_backend(), "reference")
