"""MLA ops by backend: `mla_decode` (attention of one query token per sequence over a ragged latent cache), the
weight products around it (`absorb_query`, `expand_output`), and `mla_prefill` (attention over the expanded
heads, flash style)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.backend import KERNEL_TARGET, resolve_backend, with_reference_vjp
from pallas_kernels.mla.absorb_gpu import ROWS, absorb_query_gpu, expand_output_gpu
from pallas_kernels.mla.absorb_reference import absorb_query_reference, expand_output_reference
from pallas_kernels.mla.decode_gpu import mla_decode_gpu
from pallas_kernels.mla.decode_mgpu import HEADS as MOSAIC_MAX_HEADS
from pallas_kernels.mla.decode_mgpu import mla_decode_mgpu, mla_decode_paged_mgpu
from pallas_kernels.mla.decode_tpu import mla_decode_tpu
from pallas_kernels.mla.prefill import flash_expanded_attention
from pallas_kernels.mla.prefill_gpu import flash_expanded_attention_gpu, kernel_dims_fit
from pallas_kernels.mla.reference import gather_pages, mla_decode_reference


# Below this many cache slots (B x L) the Triton kernel stays: a Mosaic GPU call showed ~0.1 ms of idle device
# time around it on the H200 (BENCHMARKS.md), which only larger caches repay; the Mosaic kernel was measured
# faster at B x L = 2^18 (B=1, L=262144) and above.
MOSAIC_MIN_SLOTS = 1 << 18


def mla_decode(q_latent_BHR, q_rope_BHP, kv_cache_BLA, lengths_B, *, scale: float, backend: str = "auto"):
    """o_latent [B, H, R] in fp32.

    q_latent: q_nope already multiplied by W_UK [B, H, R]; q_rope [B, H, P] (after RoPE); kv_cache
    [B, L, R + P] = [c_kv ; k_pe] per slot; lengths [B] int32: only the first lengths[b] slots are attended.
    backend: "auto" (by jax.default_backend()), "reference" (jnp), "pallas_gpu", "pallas_tpu", or a kernel
    in Pallas interpret mode on the CPU: "interpret_gpu", "interpret_tpu" ("interpret" = "interpret_tpu").
    "pallas_gpu" runs the Mosaic GPU kernel (`decode_mgpu.py`) on a Hopper GPU for a bf16/fp16 cache, at
    most 64 heads and at least MOSAIC_MIN_SLOTS cache slots in the batch (1.8-2x faster than the Triton
    kernel on an H200 from B x L = 2^18 up, BENCHMARKS.md), the Triton kernel (`decode_gpu.py`) otherwise;
    "interpret_gpu" runs the Triton kernel.
    """
    backend = resolve_backend(backend)
    args = (q_latent_BHR, q_rope_BHP, kv_cache_BLA, lengths_B)
    if backend == "reference":
        return mla_decode_reference(*args, scale=scale)
    interpret = backend.startswith("interpret")
    if (backend == "pallas_gpu" and _mosaic_kernel_fits(q_latent_BHR, kv_cache_BLA)
            and kv_cache_BLA.shape[0] * kv_cache_BLA.shape[1] >= MOSAIC_MIN_SLOTS):
        return mla_decode_mgpu(*args, scale=scale)
    if KERNEL_TARGET[backend] == "gpu":
        return mla_decode_gpu(*args, scale=scale, interpret=interpret)
    return mla_decode_tpu(*args, scale=scale, interpret=interpret)


def mla_decode_paged(q_latent_BHR, q_rope_BHP, kv_pages_PSA, page_table_BN, lengths_B, *, scale: float,
                     backend: str = "auto"):
    """`mla_decode` over a paged latent cache (what prefix reuse needs): kv_pages [P, page_size, R + P_rope],
    page_table [B, max_pages] int32 (slot s of sequence b is row s % page_size of page
    page_table[b, s // page_size]; sequences may share pages). On a Hopper GPU ("pallas_gpu", a 16-bit cache,
    pages of a multiple of 64 slots) the Mosaic GPU kernel reads the pages in place; every other backend first
    gathers each sequence's pages into a contiguous cache (a copy of B x max_pages pages) and runs `mla_decode`.
    """
    if (resolve_backend(backend) == "pallas_gpu" and _mosaic_kernel_fits(q_latent_BHR, kv_pages_PSA)
            and kv_pages_PSA.shape[1] % 64 == 0):
        return mla_decode_paged_mgpu(q_latent_BHR, q_rope_BHP, kv_pages_PSA, page_table_BN, lengths_B, scale=scale)
    return mla_decode(q_latent_BHR, q_rope_BHP, gather_pages(kv_pages_PSA, page_table_BN), lengths_B, scale=scale,
                      backend=backend)


def _mosaic_kernel_fits(q_latent_BHR, kv_cache_BLA) -> bool:
    """A Hopper GPU (wgmma and TMA: compute capability 9.x), a 16-bit cache, <= 64 heads, 64-column tiles, and
    a cache length that is a multiple of 8 (the kernel would otherwise pad, i.e. copy, the cache every step)."""
    device = jax.devices()[0]
    return (getattr(device, "compute_capability", "").startswith("9.")
            and kv_cache_BLA.dtype in (jnp.bfloat16, jnp.float16) and q_latent_BHR.shape[1] <= MOSAIC_MAX_HEADS
            and kv_cache_BLA.shape[-1] % 64 == 0 and q_latent_BHR.shape[-1] % 256 == 0
            and kv_cache_BLA.shape[1] % 8 == 0)


def _few_rows_on_gpu(x_MHX, backend: str) -> bool:
    return KERNEL_TARGET.get(resolve_backend(backend)) == "gpu" and x_MHX.shape[0] <= ROWS


_absorb_query_gpu = with_reference_vjp(
    lambda q_nope, kv_b, interpret: absorb_query_gpu(q_nope, kv_b, interpret=interpret),
    lambda q_nope, kv_b, interpret: absorb_query_reference(q_nope, kv_b), nondiff_argnums=(2,))
_expand_output_gpu = with_reference_vjp(
    lambda o_latent, kv_b, nope, interpret: expand_output_gpu(o_latent, kv_b, nope=nope, interpret=interpret),
    lambda o_latent, kv_b, nope, interpret: expand_output_reference(o_latent, kv_b, nope), nondiff_argnums=(2, 3))


def absorb_query(q_nope_MHN, kv_b_HCR, *, backend: str = "auto"):
    """q_latent [M, H, R] fp32 = q_nope @ W_UK per head; kv_b [H, nope + v, R] is kv_b_proj's per-head view.
    On a GPU backend, up to ROWS query rows run the Pallas kernel; otherwise (and above) the jnp reference.
    Differentiable (the kernel's backward pass is the reference's)."""
    if _few_rows_on_gpu(q_nope_MHN, backend):
        return _absorb_query_gpu(q_nope_MHN, kv_b_HCR, resolve_backend(backend).startswith("interpret"))
    return absorb_query_reference(q_nope_MHN, kv_b_HCR)


def expand_output(o_latent_MHR, kv_b_HCR, nope: int, *, backend: str = "auto"):
    """[M, H, V] fp32 = o_latent @ W_UV^T per head (W_UV: each head's rows after the first `nope`); backends
    as for `absorb_query`."""
    if _few_rows_on_gpu(o_latent_MHR, backend):
        return _expand_output_gpu(o_latent_MHR, kv_b_HCR, nope, resolve_backend(backend).startswith("interpret"))
    return expand_output_reference(o_latent_MHR, kv_b_HCR, nope)


# Arguments: the seven arrays of `mla_prefill`, then scale and interpret (static).
_prefill_gpu = with_reference_vjp(
    lambda *a: flash_expanded_attention_gpu(*a[:7], scale=a[7], interpret=a[8]),
    lambda *a: flash_expanded_attention(*a[:7], scale=a[7]), nondiff_argnums=(7, 8))


def mla_prefill(q_nope_BTHN, q_pe_BTHP, latent_BSA, query_slots_BT, key_valid_BS, w_uk_HNR, w_uv_HVR, *,
                scale: float, backend: str = "auto"):
    """Attention over the expanded heads -> o [B, T, H, V] in q's dtype (arguments as for
    `pallas_kernels.mla.prefill.flash_expanded_attention`: query t sees key slot s iff s <= query_slots[b, t]
    and key_valid[b, s]).

    A GPU backend ("pallas_gpu", or "interpret_gpu" in Pallas interpret mode) runs the Triton flash kernel
    (`prefill_gpu.py`, 4.6x the jnp path on an H200 at Ling widths, BENCHMARKS.md) when the nope, rope and value
    head dims are powers of two of at least 16 (Ling: 128, 64, 128); every other case runs the jnp flash path.
    Differentiable: the kernel's backward pass is the jnp path's.
    """
    args = (q_nope_BTHN, q_pe_BTHP, latent_BSA, query_slots_BT, key_valid_BS, w_uk_HNR, w_uv_HVR)
    backend = resolve_backend(backend)
    if KERNEL_TARGET.get(backend) == "gpu" and kernel_dims_fit(q_nope_BTHN.shape[-1], q_pe_BTHP.shape[-1],
                                                              w_uv_HVR.shape[1]):
        return _prefill_gpu(*args, scale, backend.startswith("interpret"))
    return flash_expanded_attention(*args, scale=scale)
