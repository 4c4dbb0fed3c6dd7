"""MLA on GPU, Pallas with the Triton lowering: decode over a contiguous latent cache (`decode`), the absorbed
weight products of a few query rows (`absorb`) and the prefill's flash attention over expanded keys (`prefill`).
The names below are the variant's surface for tests and benchmarks; everything else is internal."""

from pallas_kernels.mla.gpu_triton.absorb import ROWS, absorb_query_gpu, expand_output_gpu, kv_b_dtype
from pallas_kernels.mla.gpu_triton.decode import default_num_splits, mla_decode_gpu, mla_decode_tokens_gpu
from pallas_kernels.mla.gpu_triton.prefill import flash_expanded_attention_gpu, kernel_dims_fit

__all__ = [
    "ROWS",
    "absorb_query_gpu",
    "default_num_splits",
    "expand_output_gpu",
    "flash_expanded_attention_gpu",
    "kernel_dims_fit",
    "kv_b_dtype",
    "mla_decode_gpu",
    "mla_decode_tokens_gpu",
]
