from pallas_kernels.mla.reference import absorbed_attention

__all__ = ["absorbed_attention"]
