from pallas_kernels.mla.ops import mla_decode
from pallas_kernels.mla.reference import absorbed_attention, mla_decode_reference

__all__ = ["absorbed_attention", "mla_decode", "mla_decode_reference"]
