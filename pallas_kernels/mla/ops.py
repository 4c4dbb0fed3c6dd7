"""MLA ops: `mla_decode` (attention of one query token per sequence over a ragged latent cache),
`mla_decode_paged` and `mla_decode_tokens` (a few query tokens per sequence), the weight products around them
(`absorb_query`, `expand_output`), and `mla_prefill` (attention over the expanded heads, flash style), each over
its variants.

VARIANTS lists every implementation by op and name; `kernel(op, name)` gives one's entry point (with its
block-size overrides, for tests and benchmarks). Without a variant named, the backend and the shapes pick (see
each op); `mla_decode_paged` takes `mla_decode`'s names ("gpu_mosaic" and "tpu_mosaic" read the pages in place,
every other variant runs on the pages gathered into a contiguous cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import variants
from pallas_kernels.backend import KERNEL_TARGET, resolve_backend, with_reference_vjp
from pallas_kernels.fp8.reference import is_quantized
from pallas_kernels.mla.gpu_mosaic import HEADS as MOSAIC_MAX_HEADS
from pallas_kernels.mla.gpu_mosaic import mla_decode_mgpu, mla_decode_paged_mgpu
from pallas_kernels.mla.gpu_mosaic_prefill import QUERY_BLOCK as MOSAIC_QUERY_BLOCK
from pallas_kernels.mla.gpu_mosaic_prefill import flash_expanded_attention_mgpu
from pallas_kernels.mla.gpu_mosaic_prefill import kernel_dims_fit as mosaic_prefill_dims_fit
from pallas_kernels.mla.gpu_triton import (
    ROWS,
    absorb_query_gpu,
    expand_output_gpu,
    flash_expanded_attention_gpu,
    kernel_dims_fit,
    kv_b_dtype,
    mla_decode_gpu,
    mla_decode_tokens_gpu,
)
from pallas_kernels.mla.reference import (
    absorb_query_reference,
    expand_output_reference,
    flash_expanded_attention,
    gather_pages,
    mla_decode_reference,
    mla_decode_tokens_reference,
)
from pallas_kernels.mla.tpu_mosaic import mla_decode_paged_tpu, mla_decode_tpu, paged_kernel_fits
from pallas_kernels.mla.tuned import MOSAIC_MIN_SLOTS
from pallas_kernels.variants import REFERENCE, Variant

VARIANTS = {
    "mla_decode": {
        REFERENCE: Variant(None, mla_decode_reference),
        "gpu_triton": Variant("gpu", mla_decode_gpu),
        "gpu_mosaic": Variant("gpu", mla_decode_mgpu),
        "tpu_mosaic": Variant("tpu", mla_decode_tpu),
    },
    "mla_decode_paged": {
        "gpu_mosaic": Variant("gpu", mla_decode_paged_mgpu),
        "tpu_mosaic": Variant("tpu", mla_decode_paged_tpu),
    },
    "mla_decode_tokens": {
        REFERENCE: Variant(None, mla_decode_tokens_reference),
        "gpu_triton": Variant("gpu", mla_decode_tokens_gpu),
    },
    "absorb_query": {REFERENCE: Variant(None, absorb_query_reference), "gpu_triton": Variant("gpu", absorb_query_gpu)},
    "expand_output": {
        REFERENCE: Variant(None, expand_output_reference),
        "gpu_triton": Variant("gpu", expand_output_gpu),
    },
    "mla_prefill": {
        REFERENCE: Variant(None, flash_expanded_attention),
        "gpu_triton": Variant("gpu", flash_expanded_attention_gpu),
        "gpu_mosaic": Variant("gpu", flash_expanded_attention_mgpu),
    },
}


def kernel(op: str, name: str):
    """The entry point of variant `name` of `op` (a key of VARIANTS)."""
    return variants.lookup(VARIANTS, op, name).kernel


def _decode_default(backend: str, q_latent_BHR, kv_cache_BLA) -> str:
    """On a GPU compiled, the Mosaic GPU kernel for a cache it fits of at least MOSAIC_MIN_SLOTS slots in the batch,
    else the Triton kernel (interpreted too); the TPU kernel on a TPU backend, the reference otherwise."""
    if (
        backend == "pallas_gpu"
        and _mosaic_kernel_fits(q_latent_BHR, kv_cache_BLA)
        and kv_cache_BLA.shape[0] * kv_cache_BLA.shape[1] >= MOSAIC_MIN_SLOTS
    ):
        return "gpu_mosaic"
    return variants.by_platform(backend, {"gpu": "gpu_triton", "tpu": "tpu_mosaic"})


def mla_decode(
    q_latent_BHR,
    q_rope_BHP,
    kv_cache_BLA,
    lengths_B,
    *,
    scale: float,
    backend: str = "auto",
    variant: str | None = None,
):
    """o_latent [B, H, R] in fp32.

    q_latent: q_nope already multiplied by W_UK [B, H, R]; q_rope [B, H, P] (after RoPE); kv_cache
    [B, L, R + P] = [c_kv ; k_pe] per slot; lengths [B] int32: only the first lengths[b] slots are attended.
    backend: "auto" (by jax.default_backend()), "reference" (jnp), "pallas_gpu", "pallas_tpu", or a kernel
    in Pallas interpret mode on the CPU: "interpret_gpu", "interpret_tpu" ("interpret" = "interpret_tpu").
    variant: a name of VARIANTS["mla_decode"]; None: "pallas_gpu" runs "gpu_mosaic" (`gpu_mosaic.py`) on a Hopper
    GPU for a bf16/fp16 cache, at most 64 heads and at least MOSAIC_MIN_SLOTS cache slots in the batch, else
    "gpu_triton" (`gpu_triton/decode.py`); "interpret_gpu" runs "gpu_triton".
    """
    backend = resolve_backend(backend)
    args = (q_latent_BHR, q_rope_BHP, kv_cache_BLA, lengths_B)
    name = variants.pick(VARIANTS, "mla_decode", variant, backend, _decode_default(backend, q_latent_BHR, kv_cache_BLA))
    return variants.run(VARIANTS, "mla_decode", name, backend, *args, scale=scale)


def mla_decode_paged(
    q_latent_BHR,
    q_rope_BHP,
    kv_pages_PSA,
    page_table_BN,
    lengths_B,
    *,
    scale: float,
    backend: str = "auto",
    variant: str | None = None,
):
    """`mla_decode` over a paged latent cache (what prefix reuse needs): kv_pages [P, page_size, R + P_rope],
    page_table [B, max_pages] int32 (slot s of sequence b is row s % page_size of page
    page_table[b, s // page_size]; sequences may share pages, entries past a sequence's length may hold anything).
    Read in place by: on a Hopper GPU ("pallas_gpu", a 16-bit cache, pages of a multiple of 64 slots), or with
    variant "gpu_mosaic", the Mosaic GPU kernel; on a TPU backend ("pallas_tpu", or "interpret_tpu" in Pallas
    interpret mode) for pages of whole sublane tiles (a multiple of 16 slots for a 16-bit cache, 8 for fp32) and a
    page table of at most `tpu_mosaic.PAGE_TABLE_MAX_BYTES` (it goes to SMEM), or with variant "tpu_mosaic", the
    Mosaic TPU kernel. Every other case first gathers each sequence's pages into a contiguous cache (a copy of
    B x max_pages pages) and runs `mla_decode` with the same backend and variant.
    """
    backend = resolve_backend(backend)
    name = _paged_default(backend, q_latent_BHR, kv_pages_PSA, page_table_BN) if variant is None else variant
    if name in VARIANTS["mla_decode_paged"]:
        name = variants.pick(VARIANTS, "mla_decode_paged", name, backend, name)
        args = (q_latent_BHR, q_rope_BHP, kv_pages_PSA, page_table_BN, lengths_B)
        return variants.run(VARIANTS, "mla_decode_paged", name, backend, *args, scale=scale)
    kv_cache_BLA = gather_pages(kv_pages_PSA, page_table_BN)
    return mla_decode(q_latent_BHR, q_rope_BHP, kv_cache_BLA, lengths_B, scale=scale, backend=backend, variant=variant)


def _paged_default(backend: str, q_latent_BHR, kv_pages_PSA, page_table_BN) -> str | None:
    """The in-place kernel `mla_decode_paged` runs without a variant named, None for the gathered pages."""
    if backend == "pallas_gpu" and _mosaic_kernel_fits(q_latent_BHR, kv_pages_PSA) and kv_pages_PSA.shape[1] % 64 == 0:
        return "gpu_mosaic"
    if KERNEL_TARGET.get(backend) == "tpu" and paged_kernel_fits(kv_pages_PSA, page_table_BN):
        return "tpu_mosaic"
    return None


def mla_decode_tokens(
    q_latent_BTHR,
    q_rope_BTHP,
    kv_cache_BLA,
    lengths_BT,
    *,
    scale: float,
    backend: str = "auto",
    variant: str | None = None,
):
    """`mla_decode` for T query tokens a sequence (the MTP verify pass): q_latent [B, T, H, R], q_rope
    [B, T, H, P], lengths [B, T] int32 (token t attends to the first lengths[b, t] slots; 0: zeros) ->
    o_latent [B, T, H, R] fp32. A GPU backend ("pallas_gpu", or "interpret_gpu" in Pallas interpret mode) runs
    "gpu_triton" (`gpu_triton/decode.py`: the tokens' heads in one head axis, the cache read once per head block
    for all of them); every other backend the jnp reference over a [B, T, L] mask."""
    backend = resolve_backend(backend)
    args = (q_latent_BTHR, q_rope_BTHP, kv_cache_BLA, lengths_BT)
    default = variants.by_platform(backend, {"gpu": "gpu_triton"})
    name = variants.pick(VARIANTS, "mla_decode_tokens", variant, backend, default)
    return variants.run(VARIANTS, "mla_decode_tokens", name, backend, *args, scale=scale)


def _on_hopper() -> bool:
    """Whether the first device is a Hopper GPU (wgmma and TMA: compute capability 9.x)."""
    return getattr(jax.devices()[0], "compute_capability", "").startswith("9.")


def _mosaic_kernel_fits(q_latent_BHR, kv_cache_BLA) -> bool:
    """A Hopper GPU, a 16-bit cache, <= 64 heads, 64-column tiles, and a cache length that is a multiple of 8 (the
    kernel would otherwise pad, i.e. copy, the cache every step)."""
    return (
        _on_hopper()
        and kv_cache_BLA.dtype in (jnp.bfloat16, jnp.float16)
        and q_latent_BHR.shape[1] <= MOSAIC_MAX_HEADS
        and kv_cache_BLA.shape[-1] % 64 == 0
        and q_latent_BHR.shape[-1] % 256 == 0
        and kv_cache_BLA.shape[1] % 8 == 0
    )


def _few_rows_variant(op: str, variant: str | None, x_MHX, backend: str) -> tuple[str, bool]:
    """(variant name, interpret): on a GPU backend "gpu_triton" for up to ROWS query rows, else the reference."""
    backend = resolve_backend(backend)
    default = "gpu_triton" if KERNEL_TARGET.get(backend) == "gpu" and x_MHX.shape[0] <= ROWS else REFERENCE
    return variants.pick(VARIANTS, op, variant, backend, default), variants.interpreted(backend)


_absorb_query_gpu = with_reference_vjp(
    lambda q_nope, kv_b, interpret: absorb_query_gpu(q_nope, kv_b, interpret=interpret),
    lambda q_nope, kv_b, interpret: absorb_query_reference(q_nope, kv_b),
    nondiff_argnums=(2,),
)
_expand_output_gpu = with_reference_vjp(
    lambda o_latent, kv_b, nope, interpret: expand_output_gpu(o_latent, kv_b, nope=nope, interpret=interpret),
    lambda o_latent, kv_b, nope, interpret: expand_output_reference(o_latent, kv_b, nope),
    nondiff_argnums=(2, 3),
)


def _dense_kv_b(kv_b_HCR, dtype):
    """kv_b as an array: a quantised weight dequantised to `dtype` (the reference's form)."""
    return kv_b_HCR.dequantize(kv_b_dtype(kv_b_HCR, dtype)) if is_quantized(kv_b_HCR) else kv_b_HCR


def absorb_query(q_nope_MHN, kv_b_HCR, *, dtype=None, backend: str = "auto", variant: str | None = None):
    """q_latent [M, H, R] fp32 = q_nope @ W_UK per head; kv_b [H, nope + v, R] is kv_b_proj's per-head view: an
    array, or a quantised weight (`ling_jax.quantized`: values and scales both split per head) that is
    dequantised to `dtype` (the model's), tile by tile inside the GPU kernel (the weight is never written dense).
    On a GPU backend, up to ROWS query rows run the Pallas kernel; otherwise (and above) the jnp reference.
    Differentiable for a dense kv_b (the kernel's backward pass is the reference's)."""
    name, interpret = _few_rows_variant("absorb_query", variant, q_nope_MHN, backend)
    if name == "gpu_triton" and is_quantized(kv_b_HCR):
        return absorb_query_gpu(q_nope_MHN, kv_b_HCR, dtype=dtype, interpret=interpret)
    if name == "gpu_triton":
        return _absorb_query_gpu(q_nope_MHN, kv_b_HCR, interpret)
    return absorb_query_reference(q_nope_MHN, _dense_kv_b(kv_b_HCR, dtype))


def expand_output(o_latent_MHR, kv_b_HCR, nope: int, *, dtype=None, backend: str = "auto", variant: str | None = None):
    """[M, H, V] fp32 = o_latent @ W_UV^T per head (W_UV: each head's rows after the first `nope`); kv_b, dtype,
    backends and variants as for `absorb_query`."""
    name, interpret = _few_rows_variant("expand_output", variant, o_latent_MHR, backend)
    if name == "gpu_triton" and is_quantized(kv_b_HCR):
        return expand_output_gpu(o_latent_MHR, kv_b_HCR, nope=nope, dtype=dtype, interpret=interpret)
    if name == "gpu_triton":
        return _expand_output_gpu(o_latent_MHR, kv_b_HCR, nope, interpret)
    return expand_output_reference(o_latent_MHR, _dense_kv_b(kv_b_HCR, dtype), nope)


def _with_flash_vjp(kernel_fn):
    """The kernel with the jnp flash path's backward pass. Arguments: the seven arrays of `mla_prefill`, then
    scale and interpret (static)."""
    return with_reference_vjp(
        lambda *a: kernel_fn(*a[:7], scale=a[7], interpret=a[8]),
        lambda *a: flash_expanded_attention(*a[:7], scale=a[7]),
        nondiff_argnums=(7, 8),
    )


_PREFILL_KERNELS = {
    "gpu_triton": _with_flash_vjp(flash_expanded_attention_gpu),
    "gpu_mosaic": _with_flash_vjp(flash_expanded_attention_mgpu),
}


def _prefill_default(backend: str, q_nope_BTHN, q_pe_BTHP, latent_BSA, query_slots_BT, key_valid_BS, w_uk, w_uv):
    """`mla_prefill`'s variant when none is named (its docstring says which)."""
    dims = (q_nope_BTHN.shape[-1], q_pe_BTHP.shape[-1], w_uv.shape[1])
    if (
        backend == "pallas_gpu"
        and _on_hopper()
        and q_nope_BTHN.dtype in (jnp.bfloat16, jnp.float16)
        and q_nope_BTHN.shape[1] >= MOSAIC_QUERY_BLOCK
        and mosaic_prefill_dims_fit(*dims)
    ):
        return "gpu_mosaic"
    return variants.by_platform(backend, {"gpu": "gpu_triton"}) if kernel_dims_fit(*dims) else REFERENCE


def mla_prefill(
    q_nope_BTHN,
    q_pe_BTHP,
    latent_BSA,
    query_slots_BT,
    key_valid_BS,
    w_uk_HNR,
    w_uv_HVR,
    *,
    scale: float,
    backend: str = "auto",
    variant: str | None = None,
):
    """Attention over the expanded heads -> o [B, T, H, V] in q's dtype (arguments as for
    `pallas_kernels.mla.reference.flash_expanded_attention`: query t sees key slot s iff s <= query_slots[b, t]
    and key_valid[b, s]).

    Without a variant named, a GPU backend ("pallas_gpu", or "interpret_gpu" in Pallas interpret mode) runs the
    Triton flash kernel ("gpu_triton", `gpu_triton/prefill.py`) when the nope, rope and value head dims are
    powers of two of at least 16 (Ling: 128, 64, 128); every other case runs the jnp flash path ("reference").
    Compiled on a Hopper GPU ("pallas_gpu"), 16-bit queries of at least 128 tokens a row run the Mosaic GPU kernel
    ("gpu_mosaic", `gpu_mosaic_prefill.py`) where its dims fit (1.19x the Triton kernel at Ling-3.0-flash's 32
    heads, 1.03x at 64, on an H100: docs/benchmarks/mla.md). Differentiable: the kernels' backward pass is the jnp
    path's.
    """
    args = (q_nope_BTHN, q_pe_BTHP, latent_BSA, query_slots_BT, key_valid_BS, w_uk_HNR, w_uv_HVR)
    backend = resolve_backend(backend)
    name = variants.pick(VARIANTS, "mla_prefill", variant, backend, _prefill_default(backend, *args))
    if name in _PREFILL_KERNELS:
        return _PREFILL_KERNELS[name](*args, scale, variants.interpreted(backend))
    return flash_expanded_attention(*args, scale=scale)
