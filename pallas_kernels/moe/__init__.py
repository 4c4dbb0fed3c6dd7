from pallas_kernels.moe.ops import (
    ExpertWeights,
    Routing,
    expert_path,
    grouped_matmul,
    moe_experts,
    routed_experts,
    select_experts,
)
from pallas_kernels.moe.reference import RoutingRule, grouped_matmul_reference, routed_experts_reference

__all__ = [
    "ExpertWeights",
    "Routing",
    "RoutingRule",
    "expert_path",
    "grouped_matmul",
    "grouped_matmul_reference",
    "moe_experts",
    "routed_experts",
    "routed_experts_reference",
    "select_experts",
]
