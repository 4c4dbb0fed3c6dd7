"""The XLA flags ling-jax's entry points set for their GPU programs, in one place.

A decode step of the full-size model is hundreds of small kernels; at batch 1 the launches between them cost a
quarter of the step (Ling-3.0-flash on one H200, 2026-12-03: 8.69 ms a step with XLA's default command buffers,
6.45 ms with these, docs/benchmarks/generation.md). XLA's command buffers replay a recorded run of kernels as one
CUDA graph; by default they cover fusions and library calls, not the custom calls of Pallas kernels nor the
`while` loop of a multi-step decode program, and only runs of several kernels. The flags below widen them to every
kind of thunk the programs have (the decode group's `while` loop and its `lax.cond`s included) down to single
kernels.

`generate.py`, `ling-serve` and the generation benchmark call `set_gpu_flags()` first thing, before jax creates its
backends (XLA reads XLA_FLAGS once, then); library code never does. A flag the user already names in XLA_FLAGS is
left as they set it (`XLA_FLAGS=--xla_gpu_enable_command_buffer=` switches command buffers off), and
`LING_JAX_XLA_FLAGS=0` leaves XLA_FLAGS alone altogether. XLA:CPU accepts and ignores the GPU flags.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

GPU_FLAGS: dict[str, str] = {
    "--xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE",
    "--xla_gpu_graph_min_graph_size": "1",
}
OFF_ENV = "LING_JAX_XLA_FLAGS"  # "0": leave XLA_FLAGS as it is


def with_gpu_flags(xla_flags: str) -> str:
    """`xla_flags` plus each of GPU_FLAGS whose name it does not already set."""
    named = {flag.split("=", 1)[0] for flag in xla_flags.split()}
    added = [f"{name}={value}" for name, value in GPU_FLAGS.items() if name not in named]
    return " ".join([*xla_flags.split(), *added])


def set_gpu_flags(environ: MutableMapping[str, str] = os.environ) -> None:
    """Add GPU_FLAGS to XLA_FLAGS in `environ` (see the module's docstring); call before the first computation."""
    if environ.get(OFF_ENV) == "0":
        return
    environ["XLA_FLAGS"] = with_gpu_flags(environ.get("XLA_FLAGS", ""))
