"""KDA on GPU, Pallas with the Triton lowering: the chunked prefill in two phases (`chunk`: phase 1 `intra`, its kernels
in `blocks` and `tril`; phase 2 `inter`; `chunk_kda_gpu_any_gate`, the variant for gates below -5, is the same with
exact diagonal blocks), the decode step (`decode`) and a layer's whole decode step between its projections
(`decode_fused`, also over a verify pass's few tokens). The names below are the variant's surface for tests,
benchmarks and the lab's phase-1 forms (`pallas_kernels.experimental.kda_fused`) that time, check or reuse one stage;
everything else is internal."""

from pallas_kernels.kda.gpu_triton.blocks import decay_blocks, sub_block_keys
from pallas_kernels.kda.gpu_triton.chunk import chunk_kda_gpu, chunk_kda_gpu_any_gate
from pallas_kernels.kda.gpu_triton.decode import kda_decode_step_gpu
from pallas_kernels.kda.gpu_triton.decode_fused import kda_decode_fused_gpu, kda_verify_fused_gpu
from pallas_kernels.kda.gpu_triton.inter import inter_chunk
from pallas_kernels.kda.gpu_triton.intra import ChunkParts, intra_chunk, intra_chunk_any_gate
from pallas_kernels.kda.gpu_triton.tril import unit_lower_inverse_16, wy_factors

__all__ = [
    "ChunkParts",
    "chunk_kda_gpu",
    "chunk_kda_gpu_any_gate",
    "decay_blocks",
    "inter_chunk",
    "intra_chunk",
    "intra_chunk_any_gate",
    "kda_decode_fused_gpu",
    "kda_decode_step_gpu",
    "kda_verify_fused_gpu",
    "sub_block_keys",
    "unit_lower_inverse_16",
    "wy_factors",
]
