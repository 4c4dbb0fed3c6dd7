from pallas_kernels.norm.ops import add_partials_rms_norm, add_rms_norm, rms_norm
from pallas_kernels.norm.reference import add_partials_rms_norm_reference, add_rms_norm_reference, rms_norm_reference

__all__ = [
    "add_partials_rms_norm",
    "add_partials_rms_norm_reference",
    "add_rms_norm",
    "add_rms_norm_reference",
    "rms_norm",
    "rms_norm_reference",
]
