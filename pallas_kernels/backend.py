"""Which implementation a kernel entry point runs: one rule for every op in pallas_kernels."""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable

import jax


class KernelBackend(enum.StrEnum):
    """Which implementation the Pallas entry points run (`resolve_backend`)."""

    AUTO = "auto"  # the platform's kernels: GPU or TPU Pallas, the jnp references on a CPU
    REFERENCE = "reference"
    PALLAS_GPU = "pallas_gpu"
    PALLAS_TPU = "pallas_tpu"
    INTERPRET = "interpret"  # = INTERPRET_TPU
    INTERPRET_GPU = "interpret_gpu"  # Pallas interpret mode on any platform (CPU tests)
    INTERPRET_TPU = "interpret_tpu"


class FP8Matmul(enum.StrEnum):
    """How a block-FP8 linear multiplies (`pallas_kernels.fp8.fp8_linear`'s modes, the policy's `fp8_matmul`)."""

    # the checkpoint's scheme by the product's size: on a GPU, W8A8 for prefill-sized products (`fp8.tuned.
    # W8A8_MIN_ROWS` rows, `moe.tuned.rows_bucket` "many_rows" experts) and the weight-only kernels for decode-sized
    # ones; weight-only numerics (dequantise-then-dot) on a CPU. A model whose checkpoint declares no dynamic
    # activation quantisation runs it as WEIGHT_ONLY (`ExecutionPolicy.for_checkpoint`)
    AUTO = "auto"
    # the FP8 weight dequantised on chip, products in the activations' dtype, at every size: the batch-invariant
    # mode (a token's output never depends on how many rows share its call)
    WEIGHT_ONLY = "weight_only"
    W8A8 = "w8a8"  # activations quantised per token in 1 x 128 groups to e4m3, FP8 x FP8 products, every size


BACKENDS = tuple(KernelBackend)
KERNEL_TARGET = {
    "pallas_gpu": "gpu",
    "interpret_gpu": "gpu",
    "pallas_tpu": "tpu",
    "interpret_tpu": "tpu",
    "interpret": "tpu",
}


def resolve_backend(backend: str) -> str:
    """ "auto" -> the Pallas kernel of jax.default_backend() (GPU or TPU), or the jnp reference on a CPU.

    "interpret_gpu" / "interpret_tpu" run that kernel in Pallas interpret mode on any platform (for CPU
    tests); "interpret" means "interpret_tpu".
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(jax.default_backend(), "reference")


def with_reference_vjp(kernel: Callable, reference: Callable, nondiff_argnums: tuple[int, ...] = ()) -> Callable:
    """kernel(*args), differentiated as reference(*args): the backward pass recomputes the jnp reference from
    the inputs (kept as residuals) and pulls the cotangent back through it. nondiff_argnums: static arguments
    (flags, sizes), passed to both and given no cotangent."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=nondiff_argnums)
    def op(*args):
        return kernel(*args)

    def with_statics(diff_args, static_args):
        diff, static = iter(diff_args), iter(static_args)
        return [next(static) if i in nondiff_argnums else next(diff) for i in range(len(diff_args) + len(static_args))]

    def forward(*args):
        return op(*args), tuple(a for i, a in enumerate(args) if i not in nondiff_argnums)

    def backward(*statics_residuals_cotangent):
        *static_args, residuals, cotangent = statics_residuals_cotangent
        _, pullback = jax.vjp(lambda *diff: reference(*with_statics(diff, static_args)), *residuals)
        return pullback(cotangent)

    op.defvjp(forward, backward)
    return op


def device_cores(backend: str) -> int | None:
    """The streaming multiprocessors of the GPU that a resolved `backend` of "pallas_gpu" compiles for; None for
    every other backend (the interpreted kernels and the reference run on a CPU, a TPU's grid runs in order) and
    where no GPU is attached (a program lowered for CUDA on a CPU)."""
    if backend != "pallas_gpu" or jax.default_backend() != "gpu":
        return None
    return getattr(jax.devices()[0], "core_count", None)
