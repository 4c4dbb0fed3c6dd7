"""How a Ling checkpoint stores each tensor (spec §6.2, §6.3).

`stored_kind` classifies a tensor at hand, for the loaders (`ling_jax.checkpoints.hf`) and the converter
(`convert.source`): block FP8 iff float8 with a `weight_scale_inv` sibling, packed MXFP4 iff (u)int8 with one,
else plain. `storage_kind` is what a published checkpoint that is not at hand holds, by a tensor's original name:
block FP8 for the projections, MLPs, experts and the MTP eh_proj; bfloat16 for what SGLang never quantises
(embeddings, lm_head, norms, router, the MLA head-wise gate, the KDA b_proj); float32 for A_log, dt_bias, the convs
and the expert bias; MXFP4 routed experts in the mixed checkpoints. It serves the synthetic test checkpoints
(`convert.synthetic`) and the memory plan of a preset (`ling_jax.generation.memory_plan`).
"""

from __future__ import annotations

import re

import numpy as np

from ling_jax.config import KDA, LingConfig
from ling_jax.quant import is_float8

# how a tensor at hand is stored (`stored_kind`)
PLAIN, FP8, MXFP4 = "plain", "fp8", "mxfp4"
# what else a published checkpoint holds (`storage_kind`)
FP32, BF16 = "fp32", "bf16"

_KEEP_FP32 = re.compile(r"\.(A_log|dt_bias|expert_bias|e_score_correction_bias)$|_conv1d\.weight$")
_ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
_KDA_GATE = re.compile(r"^model\.layers\.(\d+)\.attention\.g_proj\.weight$")  # the MLA g_proj is never FP8
_FP8_MODULES = re.compile(
    r"\.attention\.(q_proj|k_proj|v_proj|f_proj|dense|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj"
    r"|f_a_proj|f_b_proj|g_a_proj|g_b_proj)\.weight$"
    r"|\.mlp\.(gate_proj|up_proj|down_proj|shared_experts\.(gate|up|down)_proj|experts\.\d+\.(gate|up|down)_proj)"
    r"\.weight$"
    r"|\.eh_proj\.weight$"
)


def stored_kind(dtype: np.dtype, scaled: bool) -> str:
    """PLAIN, FP8 or MXFP4 for a tensor stored as `dtype`, with a `weight_scale_inv` sibling iff `scaled`."""
    if not scaled:
        return PLAIN
    if is_float8(dtype):
        return FP8
    return MXFP4 if dtype in (np.uint8, np.int8) else PLAIN


def storage_kind(name: str, config: LingConfig, mxfp4_experts: bool) -> str:
    """FP32, BF16, FP8 or MXFP4 for the tensor stored under the original name `name`."""
    if _KEEP_FP32.search(name):
        return FP32
    if mxfp4_experts and _ROUTED_EXPERT.search(name):
        return MXFP4
    kda_gate = _KDA_GATE.match(name)
    if kda_gate:
        layer = int(kda_gate[1])
        return FP8 if layer < config.num_hidden_layers and config.layer_types[layer] == KDA else BF16
    return FP8 if _FP8_MODULES.search(name) else BF16
