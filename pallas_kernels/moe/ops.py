"""MoE expert ops by backend: `grouped_matmul` (the expert GEMM over rows sorted by expert, one weight per
group), its fused neighbours `gather_swiglu` (gate/up + SwiGLU over rows gathered from the unsorted
activations) and `down_scatter` (down, weighted per row, stored to each row's original place), and
`routed_experts` (a few tokens' picked experts, row by row, combined)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.backend import KERNEL_TARGET, resolve_backend, with_reference_vjp
from pallas_kernels.moe.decode_gpu import routed_experts_gpu
from pallas_kernels.moe.fused_gpu import down_scatter_gpu, gather_swiglu_gpu
from pallas_kernels.moe.fused_reference import down_scatter_reference, gather_swiglu_reference
from pallas_kernels.moe.gmm_gpu import grouped_matmul_gpu, grouped_weight_grad_gpu
from pallas_kernels.moe.reference import grouped_matmul_reference, routed_experts_reference, swiglu


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _gather_swiglu_gpu(x_XD, source_R, group_sizes_G, gate_GID, up_GID, limit, fill_tail, interpret):
    return gather_swiglu_gpu(x_XD, source_R, group_sizes_G, gate_GID, up_GID, limit=limit, fill_tail=fill_tail,
                             interpret=interpret)


def _gather_swiglu_gpu_fwd(x_XD, source_R, group_sizes_G, gate_GID, up_GID, limit, fill_tail, interpret):
    h_RI = _gather_swiglu_gpu(x_XD, source_R, group_sizes_G, gate_GID, up_GID, limit, fill_tail, interpret)
    return h_RI, (x_XD, source_R, group_sizes_G, gate_GID, up_GID)


def _gather_swiglu_gpu_bwd(limit, fill_tail, interpret, residuals, d_h_RI):
    """Recomputes the gate and up products from a materialised x[source] (nothing [R, I] is kept from the
    forward pass), then the plain grouped-matmul kernels: d_x rows through the transposed weights, summed
    back onto x's rows (a token's repeats add up), and the weight-grad kernel for gate and up."""
    del fill_tail  # the tail's cotangent rows meet no expert: they add nothing
    x_XD, source_R, group_sizes_G, gate_GID, up_GID = residuals
    dtype = x_XD.dtype
    x_RD = x_XD[source_R]
    gate_RI, up_RI = (grouped_matmul_gpu(x_RD, w.astype(dtype), group_sizes_G, interpret=interpret)
                      for w in (gate_GID, up_GID))
    _, swiglu_vjp = jax.vjp(lambda g, u: swiglu(g, u, limit), gate_RI.astype(jnp.float32), up_RI.astype(jnp.float32))
    d_gate_RI, d_up_RI = (d.astype(dtype) for d in swiglu_vjp(d_h_RI.astype(jnp.float32)))
    d_x_RD = sum(grouped_matmul_gpu(d, w.astype(dtype), group_sizes_G, rhs_transposed=True,
                                    interpret=interpret).astype(jnp.float32)
                 for d, w in ((d_gate_RI, gate_GID), (d_up_RI, up_GID)))
    d_x_XD = jnp.zeros(x_XD.shape, jnp.float32).at[source_R].add(d_x_RD).astype(dtype)
    d_gate_GID, d_up_GID = (grouped_weight_grad_gpu(x_RD, d, group_sizes_G, interpret=interpret).astype(w.dtype)
                            for d, w in ((d_gate_RI, gate_GID), (d_up_RI, up_GID)))
    return d_x_XD, None, None, d_gate_GID, d_up_GID


_gather_swiglu_gpu.defvjp(_gather_swiglu_gpu_fwd, _gather_swiglu_gpu_bwd)


def gather_swiglu(x_XD, source_R, group_sizes_G, gate_GID, up_GID, limit: float | None, *,
                  backend: str = "auto", fill_tail: bool = True) -> jax.Array:
    """h [R, I] in x's dtype: h[r] = swiglu(x[source[r]] @ gate[g].T, x[source[r]] @ up[g].T, limit) for the
    rows r of group g: the rows sorted by group (group_sizes int32 [G], traced, sum <= R), each read from x's
    row source[r] (int32 [R], repeats allowed); rows past the sum give zeros, or with fill_tail False are
    undefined (the GPU kernel skips them; other backends still give zeros). gate, up [G, I, D].

    backend as for `grouped_matmul`: the GPU backends run one fused kernel (the rows gathered inside it, both
    products and the SwiGLU in fp32 before the one store); the others the jnp reference. Differentiable in x,
    gate and up; the GPU backward pass recomputes the products with the grouped-matmul kernels.
    """
    backend = resolve_backend(backend)
    if KERNEL_TARGET.get(backend) == "gpu":
        return _gather_swiglu_gpu(x_XD, source_R, group_sizes_G, gate_GID, up_GID, limit, fill_tail,
                                  backend.startswith("interpret"))
    return gather_swiglu_reference(x_XD, source_R, group_sizes_G, gate_GID, up_GID, limit)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _down_scatter_gpu(h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI, fill_tail, interpret):
    return down_scatter_gpu(h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI, fill_tail=fill_tail,
                            interpret=interpret)


def _down_scatter_gpu_fwd(h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI, fill_tail, interpret):
    y_RD = _down_scatter_gpu(h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI, fill_tail, interpret)
    return y_RD, (h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI)


def _down_scatter_gpu_bwd(fill_tail, interpret, residuals, d_y_RD):
    """The plain grouped-matmul kernels on d_y gathered into sorted order: one transposed product gives the
    unweighted d_h, hence d_h (times the row weight) and d_row_weight (its dot with h); the weight-grad kernel
    gives d_down from the weighted h."""
    del fill_tail  # the tail rows meet no expert: zero cotangents for h and the row weights there
    h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI = residuals
    dtype = h_RI.dtype
    d_y_sorted_RD = d_y_RD[dest_R]
    d_product_RI = grouped_matmul_gpu(d_y_sorted_RD, down_GDI.astype(dtype), group_sizes_G, rhs_transposed=True,
                                      interpret=interpret).astype(jnp.float32)
    row_weight_R1 = row_weight_R.astype(jnp.float32)[:, None]
    d_h_RI = (row_weight_R1 * d_product_RI).astype(dtype)
    d_row_weight_R = jnp.sum(d_product_RI * h_RI.astype(jnp.float32), axis=1).astype(row_weight_R.dtype)
    weighted_h_RI = (row_weight_R1 * h_RI.astype(jnp.float32)).astype(dtype)
    d_down_GDI = grouped_weight_grad_gpu(weighted_h_RI, d_y_sorted_RD, group_sizes_G, interpret=interpret)
    return d_h_RI, None, d_row_weight_R, None, d_down_GDI.astype(down_GDI.dtype)


_down_scatter_gpu.defvjp(_down_scatter_gpu_fwd, _down_scatter_gpu_bwd)


def down_scatter(h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI, *, backend: str = "auto",
                 fill_tail: bool = True) -> jax.Array:
    """y [R, D] in h's dtype: y[dest[r]] = row_weight[r] * (h[r] @ down[g].T) for the rows r of group g: h's
    rows sorted by group (group_sizes int32 [G], traced, sum <= R), each stored back to its original row
    dest[r] (int32 [R], a permutation of [0, R)); row_weight fp32 [R], applied to the fp32 accumulator; rows
    past the sum store zeros, or with fill_tail False leave their dest rows undefined (GPU kernel; other
    backends still store zeros). down [G, D, I].

    backend as for `grouped_matmul`: the GPU backends run one kernel (scattered stores, no unsort pass); the
    others the jnp reference. Differentiable in h, row_weight and down; the GPU backward pass uses the
    grouped-matmul kernels.
    """
    backend = resolve_backend(backend)
    if KERNEL_TARGET.get(backend) == "gpu":
        return _down_scatter_gpu(h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI, fill_tail,
                                 backend.startswith("interpret"))
    return down_scatter_reference(h_RI, dest_R, row_weight_R, group_sizes_G, down_GDI)


_routed_gpu_kernel = with_reference_vjp(
    lambda x, weights, experts, gate, up, down, shared, limit, shared_limit, interpret: routed_experts_gpu(
        x, weights, experts, gate, up, down, shared, limit=limit, shared_limit=shared_limit, interpret=interpret),
    lambda x, weights, experts, gate, up, down, shared, limit, shared_limit, interpret: routed_experts_reference(
        x, weights, experts, gate, up, down, limit, shared, shared_limit),
    nondiff_argnums=(7, 8, 9))


def routed_experts(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, limit: float | None, *,
                   shared=None, shared_limit: float | None = None, backend: str = "auto") -> jax.Array:
    """sum_k weights[t, k] * FFN_{experts[t, k]}(x[t]) -> [T, D] in x's dtype (fp32 accumulation); FFN_e is
    expert e's SwiGLU, min(SiLU(x W_gate), limit) * clip(x W_up, +-limit) W_down with a limit. Weights
    [E, I, D] (gate, up) and [E, D, I] (down) in the checkpoint's [out, in] layout; experts outside [0, E)
    contribute nothing. shared: None, or the MoE's shared expert (gate [I, D], up [I, D], down [D, I], the
    routed experts' width), clipped at `shared_limit` and added with weight 1.

    For a few tokens (decode): the GPU kernels read each row's expert directly, with no sorting, and cost a
    weight read per token-expert pair; the shared expert is one more row per token. backend: "auto" (the GPU
    kernels on a GPU, the reference elsewhere), "reference", "pallas_gpu", "interpret_gpu"; TPU names run the
    reference. Differentiable (the backward pass is the reference's).
    """
    backend = resolve_backend(backend)
    shared = None if shared is None else tuple(shared)
    if KERNEL_TARGET.get(backend) == "gpu":
        return _routed_gpu_kernel(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, shared, limit,
                                  shared_limit, backend.startswith("interpret"))
    return routed_experts_reference(x_TD, weights_TK, experts_TK, gate_EID, up_EID, down_EDI, limit, shared,
                                    shared_limit)
