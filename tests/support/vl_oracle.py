"""The reference for the vision side: transformers' `Qwen3VLMoeVisionModel` (torch, CPU), tiny and with every
parameter randomised (LayerNorm weights and biases included), plus helpers to copy its weights into ours."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from optional_deps import from_transformers

(Qwen3VLMoeVisionConfig,) = from_transformers(
    "transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe", "Qwen3VLMoeVisionConfig"
)
(Qwen3VLMoeVisionModel,) = from_transformers(
    "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeVisionModel"
)

# head_dim 8 (2-D RoPE needs a multiple of 4), a 6 x 6 position table, patches of 3 x 2 x 4 x 4 = 96 values
TINY_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=48,
    num_heads=4,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=24,
    num_position_embeddings=36,
    in_channels=3,
    hidden_act="gelu_pytorch_tanh",
    deepstack_visual_indexes=[],
)


def build_vision_oracle(seed: int = 0, **overrides) -> Qwen3VLMoeVisionModel:
    config = Qwen3VLMoeVisionConfig(**{**TINY_VISION, **overrides})
    torch.manual_seed(seed)
    model = Qwen3VLMoeVisionModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def vision_oracle_output(model: Qwen3VLMoeVisionModel, pixels: np.ndarray, grids) -> np.ndarray:
    """The merger output [N / merge^2, out_hidden_size] in float64."""
    grid_thw = torch.tensor([[g.t, g.h, g.w] for g in grids], dtype=torch.long)
    with torch.no_grad():
        out = model(torch.from_numpy(np.asarray(pixels, np.float32)), grid_thw=grid_thw)
    return out.pooler_output.double().numpy()


def copy_weights(torch_module: torch.nn.Module, module: nnx.Module, prefix: str = "") -> None:
    """Copy a torch module's parameters into an NNX module whose parameter paths spell the same names."""
    state = {k: v.detach().float().numpy() for k, v in torch_module.state_dict().items()}
    for path, variable in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        name = prefix + ".".join(str(p) for p in path)
        value = state.pop(name)
        if value.shape != variable.get_value().shape:
            raise ValueError(f"{name}: torch {value.shape} vs ours {variable.get_value().shape}")
        variable.set_value(jnp.asarray(value, variable.get_value().dtype))
    if state:
        raise ValueError(f"torch parameters not copied: {sorted(state)}")
