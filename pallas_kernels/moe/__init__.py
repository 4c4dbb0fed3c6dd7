from pallas_kernels.moe.ops import grouped_matmul, routed_experts
from pallas_kernels.moe.reference import grouped_matmul_reference, routed_experts_reference

__all__ = ["grouped_matmul", "grouped_matmul_reference", "routed_experts", "routed_experts_reference"]
