"""ling-jax: Ling 3.x hybrid (KDA + gated MLA + MoE) models in JAX / Flax NNX."""

from ling_jax.cache import KDAState, LingCache, MLAState, MTPCache
from ling_jax.checkpoint import load_hf_checkpoint
from ling_jax.config import LingConfig
from ling_jax.model import LingForCausalLM, LingOutput
from ling_jax.orbax_checkpoint import load_checkpoint

__all__ = [
    "KDAState",
    "LingCache",
    "LingConfig",
    "LingForCausalLM",
    "LingOutput",
    "MLAState",
    "MTPCache",
    "load_checkpoint",
    "load_hf_checkpoint",
]
