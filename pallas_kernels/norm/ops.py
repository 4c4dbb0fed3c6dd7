"""RMSNorm entry points by backend: `rms_norm` and `add_rms_norm` (the residual add and the norm after it)."""

from __future__ import annotations

from pallas_kernels.backend import KERNEL_TARGET, resolve_backend, with_reference_vjp
from pallas_kernels.norm.reference import add_rms_norm_reference, rms_norm_reference
from pallas_kernels.norm.rmsnorm_gpu import add_rms_norm_gpu, rms_norm_gpu


def _runs_gpu_kernel(backend: str, x) -> bool:
    """The GPU kernel needs a power-of-two row (its block is the whole row); other widths use the reference."""
    dim = x.shape[-1]
    return KERNEL_TARGET.get(resolve_backend(backend)) == "gpu" and dim & (dim - 1) == 0


_rms_norm_gpu = with_reference_vjp(
    lambda x, weight_D, eps, interpret: rms_norm_gpu(x, weight_D, eps=eps, interpret=interpret),
    lambda x, weight_D, eps, interpret: rms_norm_reference(x, weight_D, eps), nondiff_argnums=(2, 3))
_add_rms_norm_gpu = with_reference_vjp(
    lambda x, residual, weight_D, eps, interpret: add_rms_norm_gpu(x, residual, weight_D, eps=eps,
                                                                   interpret=interpret),
    lambda x, residual, weight_D, eps, interpret: add_rms_norm_reference(x, residual, weight_D, eps),
    nondiff_argnums=(3, 4))


def rms_norm(x, weight_D, eps: float, *, backend: str = "auto"):
    """weight * (x / rms(x)) over the last axis, in x's dtype (`rms_norm_reference`). backend: "auto" (the GPU
    kernel on a GPU, the reference elsewhere), "reference", "pallas_gpu", "interpret_gpu"; TPU names run the
    reference. Differentiable; the GPU backward pass is the reference's."""
    if _runs_gpu_kernel(backend, x):
        return _rms_norm_gpu(x, weight_D, eps, resolve_backend(backend).startswith("interpret"))
    return rms_norm_reference(x, weight_D, eps)


def add_rms_norm(x, residual, weight_D, eps: float, *, backend: str = "auto"):
    """(x + residual, rms_norm(x + residual)) in x's dtype, one kernel on a GPU; backends as for `rms_norm`."""
    if _runs_gpu_kernel(backend, x):
        return _add_rms_norm_gpu(x, residual, weight_D, eps, resolve_backend(backend).startswith("interpret"))
    return add_rms_norm_reference(x, residual, weight_D, eps)
