from pallas_kernels.mla.ops import mla_decode, mla_decode_paged, mla_decode_tokens, mla_prefill
from pallas_kernels.mla.reference import absorbed_attention, mla_decode_paged_reference, mla_decode_reference

__all__ = [
    "absorbed_attention",
    "mla_decode",
    "mla_decode_paged",
    "mla_decode_paged_reference",
    "mla_decode_reference",
    "mla_decode_tokens",
    "mla_prefill",
]
