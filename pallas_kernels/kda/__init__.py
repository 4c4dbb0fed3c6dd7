from pallas_kernels.kda.ops import chunk_kda, kda_decode_fused, kda_decode_step, kda_verify_fused
from pallas_kernels.kda.reference import BetaProjection, DecodeWeights, kda_chunked, kda_recurrent, l2_normalize

__all__ = [
    "BetaProjection",
    "DecodeWeights",
    "chunk_kda",
    "kda_chunked",
    "kda_decode_fused",
    "kda_decode_step",
    "kda_recurrent",
    "kda_verify_fused",
    "l2_normalize",
]
