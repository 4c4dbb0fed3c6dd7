"""KDA on TPU, Pallas with the Mosaic lowering: the chunked prefill over 16-token chunks (`chunk`, its layout in
`prep`, the per-chunk maths `kda.chunk_math`) and the decode step (`decode`)."""

from pallas_kernels.kda.tpu_mosaic.chunk import chunk_kda_tpu
from pallas_kernels.kda.tpu_mosaic.decode import kda_decode_step_tpu

__all__ = ["chunk_kda_tpu", "kda_decode_step_tpu"]
