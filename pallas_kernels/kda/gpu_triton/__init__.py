"""KDA on GPU, Pallas with the Triton lowering: the chunked prefill in two phases (`chunk`: phase 1 `intra`, its
kernels in `blocks` and `tril`; phase 2 `inter`; `chunk_kda_gpu_any_gate`, the variant for gates below -5, is the
same with exact diagonal blocks; `chunk_kda_gpu_fused` runs phase 1 over whole chunks, `fused`, in one kernel or two)
and the decode step (`decode`). The names below are the variant's
surface for tests and benchmarks that time or check one stage; everything else is internal."""

from pallas_kernels.kda.gpu_triton.blocks import decay_blocks, sub_block_keys
from pallas_kernels.kda.gpu_triton.chunk import (
    chunk_kda_gpu,
    chunk_kda_gpu_any_gate,
    chunk_kda_gpu_fused,
)
from pallas_kernels.kda.gpu_triton.decode import kda_decode_step_gpu
from pallas_kernels.kda.gpu_triton.fused import chunk_blocks
from pallas_kernels.kda.gpu_triton.inter import inter_chunk
from pallas_kernels.kda.gpu_triton.intra import ChunkParts, Phase1, fused_intra_chunk, intra_chunk
from pallas_kernels.kda.gpu_triton.tril import unit_lower_inverse_16, wy_factors

__all__ = [
    "ChunkParts",
    "Phase1",
    "chunk_blocks",
    "chunk_kda_gpu",
    "chunk_kda_gpu_any_gate",
    "chunk_kda_gpu_fused",
    "decay_blocks",
    "fused_intra_chunk",
    "inter_chunk",
    "intra_chunk",
    "kda_decode_step_gpu",
    "sub_block_keys",
    "unit_lower_inverse_16",
    "wy_factors",
]
