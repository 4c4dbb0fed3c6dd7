"""KDA on TPU, Pallas with the Mosaic lowering: the chunked prefill over 16-token chunks (`chunk`, its layout in
`prep`, the per-chunk maths `kda.chunk_math` and, for gates of any size, `kda.exact_decay`) and the decode step
(`decode`)."""

from pallas_kernels.kda.tpu_mosaic.chunk import chunk_kda_tpu, chunk_kda_tpu_any_gate
from pallas_kernels.kda.tpu_mosaic.decode import kda_decode_step_tpu

__all__ = ["chunk_kda_tpu", "chunk_kda_tpu_any_gate", "kda_decode_step_tpu"]
