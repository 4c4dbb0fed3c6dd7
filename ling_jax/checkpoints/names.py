"""The map between checkpoint tensor names (spec §6.1) and NNX parameter paths, as data.

Parameter paths follow the checkpoint names, so most entries are the path joined with dots. The exceptions
are listed here: stacked experts (one checkpoint tensor per expert), convs stored [C, 1, K], tensors with
no `.weight` suffix, the MTP layer stored as layer index L, and accepted alternative spellings.
"""

from __future__ import annotations

import dataclasses
import re

from ling_jax.config import LingConfig

STACKED_EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")  # Experts params: [E, ...] stacks
CONV_LEAVES = ("q_conv1d", "k_conv1d", "v_conv1d")  # [C, K] here, [C, 1, K] in checkpoints
BARE_LEAVES = ("A_log", "dt_bias", "expert_bias")  # checkpoint names without a ".weight" suffix

VL_PREFIXES = ("visual", "linear_proj")  # VL parameters, stored under `model.` (spec §7)

# alternative spelling in a checkpoint -> the name used here
ALIASES = (
    (re.compile(r"\.attention\.o_proj\."), ".attention.dense."),
    (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), ".mlp.gate.expert_bias"),
    (re.compile(r"^linear_proj\."), "model.linear_proj."),
    (re.compile(r"^(model\.visual\..*\.attn\.)qkv_proj\."), r"\1qkv."),
)


def ignored(name: str, config: LingConfig) -> bool:
    """Tensors that are legitimately present but unused (as SGLang skips them)."""
    mtp_prefix = f"model.layers.{config.mtp_layer_index}."
    return (
        "inv_freq" in name
        or name.startswith("model.mtp")
        or (name.startswith(mtp_prefix) and (".shared_head." in name or ".embed_tokens." in name))
        # Qwen3-VL deepstack mergers: SGLang's Bailing VL keeps only the main merger's output
        or name.startswith("model.visual.deepstack_merger_list.")
    )


def canonical(name: str) -> str:
    for pattern, replacement in ALIASES:
        name = pattern.sub(replacement, name)
    return name


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """Where one parameter comes from: a single tensor, or one tensor per expert stacked along axis 0."""

    names: tuple[str, ...]
    shape: tuple[int, ...]  # each checkpoint tensor's logical (dequantised) shape
    stacked: bool = False


def source_for(path: tuple, shape: tuple[int, ...], config: LingConfig) -> TensorSource:
    """The checkpoint tensor(s) that fill the parameter at `path` (an NNX flat-state path) of `shape`."""
    parts = [str(p) for p in path]
    if parts[0] in VL_PREFIXES:
        return TensorSource(("model." + ".".join(parts),), tuple(shape))
    if parts[0] == "mtp":
        parts = ["model", "layers", str(config.mtp_layer_index), *parts[1:]]
    leaf = parts[-1]
    if leaf in STACKED_EXPERT_LEAVES and len(parts) >= 2 and parts[-2] == "experts":
        prefix = ".".join(parts[:-1])
        names = tuple(f"{prefix}.{e}.{leaf}.weight" for e in range(shape[0]))
        return TensorSource(names, tuple(shape[1:]), stacked=True)
    if leaf in CONV_LEAVES:
        return TensorSource((".".join(parts) + ".weight",), (shape[0], 1, shape[1]))
    if leaf in BARE_LEAVES:
        return TensorSource((".".join(parts),), tuple(shape))
    return TensorSource((".".join(parts),), tuple(shape))
