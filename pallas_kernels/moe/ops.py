"""MoE expert ops by backend: `grouped_matmul` (the expert GEMM over rows sorted by expert, one weight per
group) and `routed_experts` (a few tokens' picked experts, row by row, combined)."""

from __future__ import annotations

import functools

import jax

from pallas_kernels.backend import KERNEL_TARGET, resolve_backend
from pallas_kernels.moe.decode_gpu import routed_experts_gpu
from pallas_kernels.moe.gmm_gpu import grouped_matmul_gpu, grouped_weight_grad_gpu
from pallas_kernels.moe.reference import grouped_matmul_reference, routed_experts_reference


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _routed_gpu_kernel(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, limit, interpret):
    return routed_experts_gpu(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, limit=limit,
                              interpret=interpret)


def _routed_gpu_kernel_fwd(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, limit, interpret):
    out = _routed_gpu_kernel(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, limit, interpret)
    return out, (x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI)


def _routed_gpu_kernel_bwd(limit, interpret, residuals, d_out_TD):
    x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI = residuals

    def reference(x, weights, gate, up, down):
        return routed_experts_reference(x, weights, experts_TK, gate, up, down, limit)

    _, pullback = jax.vjp(reference, x_TD, weights_TK, gate_EID, up_EID, down_EDI)
    d_x, d_weights, d_gate, d_up, d_down = pullback(d_out_TD)
    return d_x, d_weights, None, d_gate, d_up, d_down


_routed_gpu_kernel.defvjp(_routed_gpu_kernel_fwd, _routed_gpu_kernel_bwd)


def routed_experts(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, limit: float | None, *,
                   backend: str = "auto") -> jax.Array:
    """sum_k weights[t, k] * FFN_{experts[t, k]}(x[t]) -> [T, D] in x's dtype (fp32 accumulation); FFN_e is
    expert e's SwiGLU, min(SiLU(x W_gate), limit) * clip(x W_up, +-limit) W_down with a limit. Weights
    [E, I, D] (gate, up) and [E, D, I] (down) in the checkpoint's [out, in] layout; experts outside [0, E)
    contribute nothing.

    For a few tokens (decode): the GPU kernels read each row's expert directly, with no sorting, and cost a
    weight read per token-expert pair. backend: "auto" (the GPU kernels on a GPU, the reference elsewhere),
    "reference", "pallas_gpu", "interpret_gpu"; TPU names run the reference. Differentiable (the backward
    pass is the reference's).
    """
    backend = resolve_backend(backend)
    if KERNEL_TARGET.get(backend) == "gpu":
        return _routed_gpu_kernel(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, limit,
                                  backend.startswith("interpret"))
    return routed_experts_reference(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, limit)
