"""`grouped_matmul`: the MoE expert GEMM over rows sorted by expert, one weight per group."""

from __future__ import annotations

import functools

import jax

from pallas_kernels.backend import KERNEL_TARGET, resolve_backend
from pallas_kernels.moe.gmm_gpu import grouped_matmul_gpu, grouped_weight_grad_gpu
from pallas_kernels.moe.reference import grouped_matmul_reference


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gpu_kernel(lhs_MK, rhs_GNK, group_sizes_G, interpret: bool):
    return grouped_matmul_gpu(lhs_MK, rhs_GNK, group_sizes_G, interpret=interpret)


def _gpu_kernel_fwd(lhs_MK, rhs_GNK, group_sizes_G, interpret):
    return _gpu_kernel(lhs_MK, rhs_GNK, group_sizes_G, interpret), (lhs_MK, rhs_GNK, group_sizes_G)


def _gpu_kernel_bwd(interpret, residuals, d_out_MN):
    lhs_MK, rhs_GNK, group_sizes_G = residuals
    d_lhs_MK = grouped_matmul_gpu(d_out_MN, rhs_GNK, group_sizes_G, rhs_transposed=True, interpret=interpret)
    d_rhs_GNK = grouped_weight_grad_gpu(lhs_MK, d_out_MN, group_sizes_G, interpret=interpret)
    return d_lhs_MK, d_rhs_GNK.astype(rhs_GNK.dtype), None


_gpu_kernel.defvjp(_gpu_kernel_fwd, _gpu_kernel_bwd)


def grouped_matmul(lhs_MK, rhs_GNK, group_sizes_G, *, backend: str = "auto") -> jax.Array:
    """out [M, N] in lhs's dtype (fp32 accumulation): out[rows of g] = lhs[rows of g] @ rhs[g].T.

    lhs [M, K] rows sorted by group (the first group_sizes[0] rows are group 0, ...); rhs [G, N, K] in the
    checkpoint's [out, in] layout; group_sizes int32 [G], traced, sum <= M; rows past the sum give zeros.
    backend: "auto" (the GPU kernel on a GPU, the jnp reference elsewhere), "reference" (jnp ragged dot),
    "pallas_gpu", or "interpret_gpu" (the GPU kernel in Pallas interpret mode, for CPU tests). There is no
    TPU kernel yet: "pallas_tpu", "interpret_tpu" and "interpret" (and "auto" on a TPU) run the reference.
    Differentiable in lhs and rhs with every backend; the GPU backends take their gradients from the GPU
    kernels too (XLA's GPU ragged_dot materialises a masked lhs per group: out of memory at MoE sizes).
    """
    backend = resolve_backend(backend)
    if KERNEL_TARGET.get(backend) == "gpu":
        return _gpu_kernel(lhs_MK, rhs_GNK, group_sizes_G, backend.startswith("interpret"))
    return grouped_matmul_reference(lhs_MK, rhs_GNK, group_sizes_G)
