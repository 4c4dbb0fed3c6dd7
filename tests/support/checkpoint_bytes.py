"""The bytes of a block-FP8 Ling checkpoint by plain arithmetic over a config's widths: the spec's tensor list
(§6.1) and storage rule (§6.2: FP8 with float32 128 x 128 scales for the projections, MLPs, experts and the MTP
eh_proj; bf16 embeddings, lm_head, norms, router, MLA gate and KDA b_proj; float32 convs, A_log, dt_bias and
expert bias), independent of the model code."""

import math

from ling_jax.config import DENSE, KDA

BLOCK = 128


def fp8(rows: int, cols: int) -> int:
    """An FP8 linear [rows, cols]: one byte per weight plus a float32 scale per (partial) 128 x 128 block."""
    return rows * cols + 4 * math.ceil(rows / BLOCK) * math.ceil(cols / BLOCK)


def checkpoint_bytes(c) -> int:
    d, h, hd = c.hidden_size, c.num_attention_heads, c.head_dim
    kda_width = h * hd
    bf16, fp32 = 2, 4

    def kda_layer():  # q, k, v, f, g projections and the output in FP8; b_proj bf16; convs, A_log, dt_bias fp32
        return (
            5 * fp8(kda_width, d)
            + fp8(d, kda_width)
            + h * d * bf16
            + 3 * kda_width * c.short_conv_kernel_size * fp32
            + h * fp32
            + kda_width * fp32
            + hd * bf16
        )

    def mla_layer():  # the head-wise gate [H, D] and the norms stay bf16
        qk = h * (c.qk_nope_head_dim + c.qk_rope_head_dim)
        if c.q_lora_rank:
            query = fp8(c.q_lora_rank, d) + c.q_lora_rank * bf16 + fp8(qk, c.q_lora_rank)
        else:
            query = fp8(qk, d)
        return (
            query
            + fp8(c.kv_lora_rank + c.qk_rope_head_dim, d)
            + c.kv_lora_rank * bf16
            + fp8(h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
            + h * d * bf16
            + fp8(d, h * c.v_head_dim)
        )

    def swiglu(width):
        return 2 * fp8(width, d) + fp8(d, width)

    def moe():  # router [E, D] bf16 and its fp32 bias; every routed expert and the shared one in FP8
        e = c.num_experts
        return e * d * bf16 + e * fp32 + e * swiglu(c.moe_intermediate_size) + swiglu(c.shared_expert_intermediate_size)

    total = 2 * c.vocab_size * d * bf16 + d * bf16  # embedding, lm_head, final norm
    for attention, mlp in zip(c.layer_types, c.mlp_layer_types):
        total += kda_layer() if attention == KDA else mla_layer()
        total += (swiglu(c.intermediate_size) if mlp == DENSE else moe()) + 2 * d * bf16
    if c.num_nextn_predict_layers:  # MLA + MoE, its norms (input, post, enorm, hnorm, final) and eh_proj [D, 2D]
        total += mla_layer() + moe() + 5 * d * bf16 + fp8(d, 2 * d)
    return total
