from pallas_kernels.kda.ops import kda_decode_step
from pallas_kernels.kda.reference import kda_chunked, kda_recurrent, l2_normalize

__all__ = ["kda_chunked", "kda_decode_step", "kda_recurrent", "l2_normalize"]
