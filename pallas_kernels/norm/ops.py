"""RMSNorm entry points: `rms_norm`, `add_rms_norm` (the residual add and the norm after it) and
`add_partials_rms_norm` (the same add of a split-K product given as its fp32 partial sums), each over its
variants (VARIANTS; `kernel(op, name)` gives one's entry point). Without a variant named, a GPU backend runs
"gpu_triton" (a program a row, of any width: loaded as the next power of two of values, masked past D), every other
case the jnp reference."""

from __future__ import annotations

from pallas_kernels import variants
from pallas_kernels.backend import resolve_backend, with_reference_vjp
from pallas_kernels.norm.gpu_triton import add_partials_rms_norm_gpu, add_rms_norm_gpu, rms_norm_gpu
from pallas_kernels.norm.reference import (
    add_partials_rms_norm_reference,
    add_rms_norm_reference,
    rms_norm_reference,
)
from pallas_kernels.variants import REFERENCE, Variant

VARIANTS = {
    "rms_norm": {REFERENCE: Variant(None, rms_norm_reference), "gpu_triton": Variant("gpu", rms_norm_gpu)},
    "add_rms_norm": {REFERENCE: Variant(None, add_rms_norm_reference), "gpu_triton": Variant("gpu", add_rms_norm_gpu)},
    "add_partials_rms_norm": {
        REFERENCE: Variant(None, add_partials_rms_norm_reference),
        "gpu_triton": Variant("gpu", add_partials_rms_norm_gpu),
    },
}


def kernel(op: str, name: str):
    """The entry point of variant `name` of `op` ("rms_norm", "add_rms_norm" or "add_partials_rms_norm")."""
    return variants.lookup(VARIANTS, op, name).kernel


def _pick(op: str, variant: str | None, backend: str) -> tuple[str, bool]:
    """(variant name, interpret)."""
    backend = resolve_backend(backend)
    default = variants.by_platform(backend, {"gpu": "gpu_triton"})
    return variants.pick(VARIANTS, op, variant, backend, default), variants.interpreted(backend)


_rms_norm_gpu = with_reference_vjp(
    lambda x, weight_D, eps, interpret: rms_norm_gpu(x, weight_D, eps=eps, interpret=interpret),
    lambda x, weight_D, eps, interpret: rms_norm_reference(x, weight_D, eps),
    nondiff_argnums=(2, 3),
)
_add_rms_norm_gpu = with_reference_vjp(
    lambda x, residual, weight_D, eps, interpret: add_rms_norm_gpu(x, residual, weight_D, eps=eps, interpret=interpret),
    lambda x, residual, weight_D, eps, interpret: add_rms_norm_reference(x, residual, weight_D, eps),
    nondiff_argnums=(3, 4),
)

_add_partials_rms_norm_gpu = with_reference_vjp(
    lambda x, partials_SND, weight_D, eps, interpret: add_partials_rms_norm_gpu(
        x, partials_SND, weight_D, eps=eps, interpret=interpret
    ),
    lambda x, partials_SND, weight_D, eps, interpret: add_partials_rms_norm_reference(x, partials_SND, weight_D, eps),
    nondiff_argnums=(3, 4),
)


def rms_norm(x, weight_D, eps: float, *, backend: str = "auto", variant: str | None = None):
    """weight * (x / rms(x)) over the last axis, in x's dtype (`rms_norm_reference`). backend: "auto" (the GPU
    kernel on a GPU, the reference elsewhere), "reference", "pallas_gpu", "interpret_gpu"; TPU names run the
    reference. Differentiable; the GPU backward pass is the reference's."""
    name, interpret = _pick("rms_norm", variant, backend)
    if name == "gpu_triton":
        return _rms_norm_gpu(x, weight_D, eps, interpret)
    return rms_norm_reference(x, weight_D, eps)


def add_rms_norm(x, residual, weight_D, eps: float, *, backend: str = "auto", variant: str | None = None):
    """(x + residual, rms_norm(x + residual)) in x's dtype, one kernel on a GPU; backends as for `rms_norm`."""
    name, interpret = _pick("add_rms_norm", variant, backend)
    if name == "gpu_triton":
        return _add_rms_norm_gpu(x, residual, weight_D, eps, interpret)
    return add_rms_norm_reference(x, residual, weight_D, eps)


def add_partials_rms_norm(x, partials_SND, weight_D, eps: float, *, backend: str = "auto", variant: str | None = None):
    """`add_rms_norm(x, y)` where y is given as the fp32 partial sums [S, N, D] of a split-K product (N: x's rows;
    y = their sum cast to x's dtype, `pallas_kernels.fp8.fp8_linear_partials`): one kernel on a GPU, adding the
    partials in split order (deterministic, the same for every row count) before the residual add; backends as
    for `rms_norm`."""
    name, interpret = _pick("add_partials_rms_norm", variant, backend)
    if name == "gpu_triton":
        return _add_partials_rms_norm_gpu(x, partials_SND, weight_D, eps, interpret)
    return add_partials_rms_norm_reference(x, partials_SND, weight_D, eps)
