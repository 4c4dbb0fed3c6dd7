from pallas_kernels.moe.ops import grouped_matmul, routed_experts, select_experts
from pallas_kernels.moe.reference import RoutingRule, grouped_matmul_reference, routed_experts_reference

__all__ = [
    "RoutingRule",
    "grouped_matmul",
    "grouped_matmul_reference",
    "routed_experts",
    "routed_experts_reference",
    "select_experts",
]
