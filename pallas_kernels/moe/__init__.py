from pallas_kernels.moe.ops import grouped_matmul
from pallas_kernels.moe.reference import grouped_matmul_reference

__all__ = ["grouped_matmul", "grouped_matmul_reference"]
