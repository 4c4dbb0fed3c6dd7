"""Test harness around the real reference model (transformers' ``bailing_hybrid``).

Plain functions only (no pytest fixtures):

* ``ORACLE_CONFIGS`` - tiny ``BailingHybridConfig`` kwargs that exercise the layer schedule variants.
* ``build_oracle`` - a deterministic, eval-mode ``BailingHybridForCausalLM`` whose parameters are all
  randomised (norm weights, A_log, dt_bias, conv kernels, router weight + expert bias, ...), so that
  bugs that would be hidden by default initialisations (ones / zeros) show up.
* ``save_oracle`` - ``save_pretrained`` (safetensors, *original* Ling tensor names); ``load_oracle`` - from_pretrained.
* ``oracle_logits`` / ``oracle_router_choices`` / ``oracle_cached_logits`` - reference outputs.

Everything runs on CPU; outputs are float64 numpy arrays.
"""

from __future__ import annotations

import json
import math
import pathlib
import re

import numpy as np
import torch
from optional_deps import from_transformers

BailingHybridConfig, BailingHybridForCausalLM = from_transformers(
    "transformers", "BailingHybridConfig", "BailingHybridForCausalLM"
)

_LIN, _FULL = "linear_attention", "full_attention"

_COMMON = dict(
    num_key_value_heads=None,  # filled with num_attention_heads below
    head_dim=16,  # KDA head dim (HF overwrites config.head_dim with qk_rope_head_dim and keeps this as linear_head_dim)
    qk_rope_head_dim=8,
    qk_nope_head_dim=12,
    v_head_dim=10,
    kv_lora_rank=24,
    num_local_experts=16,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=3,
    n_shared_experts=1,
    num_mtp_layers=0,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=None,
    rms_norm_eps=1e-6,
    short_conv_kernel_size=4,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    kda_safe_gate=True,
    kda_lower_bound=-5.0,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
)


def _cfg(**kw) -> dict:
    d = dict(_COMMON)
    d.update(kw)
    if d["num_key_value_heads"] is None:
        d["num_key_value_heads"] = d["num_attention_heads"]
    return d


# the two group-size-2 configs: [KDA, MLA, KDA, MLA], a dense MLP at layer 0 only
_G2 = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=2,
    layer_group_size=2,
    first_k_dense_replace=1,
    rope_theta=10000.0,
)

ORACLE_CONFIGS: dict[str, dict] = {
    "g2_dense1": _cfg(vocab_size=103, **_G2),
    # Explicit layer_types that do NOT follow layer_group_size (g=3 would give [lin, lin, full, lin, lin, full]);
    # the explicit list must win.
    "g3_list_dense2": _cfg(
        vocab_size=113,
        hidden_size=96,
        intermediate_size=80,
        moe_intermediate_size=40,
        num_hidden_layers=6,
        num_attention_heads=3,
        layer_group_size=3,
        layer_types=[_LIN, _FULL, _LIN, _LIN, _FULL, _LIN],
        mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse", "sparse"],
        first_k_dense_replace=2,
        rope_theta=20000.0,
    ),
    # hidden 160 and Im 144 (> 128, not multiples of 128) -> partial 128x128 FP8 edge blocks.
    # NB: 144 is not a multiple of 32, so an MXFP4 down_proj [160, 144] has a partial last 32-group
    # (scale shape [160, 5], last group covers 16 elements).
    "g4_wide": _cfg(
        vocab_size=131,
        hidden_size=160,
        intermediate_size=200,
        moe_intermediate_size=144,
        num_hidden_layers=4,
        num_attention_heads=4,
        layer_group_size=4,
        first_k_dense_replace=1,
        rope_theta=5000.0,
    ),
    # Extra: the non-"safe" KDA gate (g = -A * softplus(f + dt_bias)).
    "g2_unsafe_gate": _cfg(vocab_size=101, kda_safe_gate=False, **_G2),
}

# Parameters HF keeps in fp32 regardless of the model dtype (``_keep_in_fp32_modules_strict``).
_FP32_PATTERNS = ("e_score_correction_bias", "conv1d", "dt_bias", "A_log")


def make_config(name: str) -> BailingHybridConfig:
    kw = dict(ORACLE_CONFIGS[name])
    return BailingHybridConfig(**kw, attn_implementation="eager", experts_implementation="eager")


def _randomise_(model: BailingHybridForCausalLM, seed: int) -> None:
    """Overwrite every parameter / persistent buffer with seeded random values (independent of HF init)."""
    cfg = model.config
    gen = torch.Generator().manual_seed(int(seed) + 1234567)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen, dtype=torch.float64) * std + mean

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo

    D = cfg.hidden_size
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if "e_score_correction_bias" in n})
    for name in sorted(tensors):
        t = tensors[name]
        shape = tuple(t.shape)
        if name.endswith("embed_tokens.weight"):
            v = normal(shape, 1.0)
        elif name == "lm_head.weight":
            v = normal(shape, 2.0 / math.sqrt(D))
        elif re.search(r"(norm)\.weight$", name):  # input/post/final/kv_a_layernorm/o_norm
            v = uniform(shape, 0.5, 1.5)
        elif name.endswith("conv1d.weight"):
            v = normal(shape, 0.5)
        elif name.endswith("A_log"):
            v = torch.log(uniform(shape, 0.5, 4.0))
        elif name.endswith("dt_bias"):
            # safe gate: g = -5 sigmoid(A (f + dt)); a negative shift gives a spread of decays, not all ~e^-5.
            v = normal(shape, 0.5, mean=-1.5 if cfg.kda_safe_gate else -0.5)
        elif name.endswith("mlp.gate.weight"):  # router: logits with std ~2 -> decisive sigmoid scores
            v = normal(shape, 2.0 / math.sqrt(shape[1]))
        elif name.endswith("e_score_correction_bias"):
            v = normal(shape, 0.08)
        elif name.endswith("experts.gate_up_proj"):  # [E, 2Im, D]
            v = normal(shape, 1.0 / math.sqrt(shape[-1]))
        elif name.endswith("experts.down_proj"):  # [E, D, Im]
            v = normal(shape, 1.0 / math.sqrt(shape[-1]))
        elif len(shape) == 2:  # generic Linear [out, in]
            v = normal(shape, 1.0 / math.sqrt(shape[1]))
        else:
            raise AssertionError(f"build_oracle: no randomisation rule for {name} {shape}")
        with torch.no_grad():
            t.copy_(v.to(t.dtype))


def build_oracle(name: str, seed: int = 0, dtype=torch.float32) -> BailingHybridForCausalLM:
    """Tiny deterministic reference model, eval mode, every parameter randomised."""
    cfg = make_config(name)
    torch.manual_seed(seed)
    model = BailingHybridForCausalLM(cfg)
    model = model.to(torch.float32)
    _randomise_(model, seed)
    if dtype != torch.float32:
        for pname, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "rotary_emb" in pname or any(s in pname for s in _FP32_PATTERNS):
                continue
            p.data = p.data.to(dtype)
        model.config.dtype = dtype
    model.eval()
    model.requires_grad_(False)
    return model


_EXPECTED_SAVED = (
    "model.word_embeddings.weight",
    "model.norm.weight",
    "lm_head.weight",
)


def save_oracle(model: BailingHybridForCausalLM, path) -> pathlib.Path:
    """save_pretrained (safetensors) and verify that the original Ling tensor names were written."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    names = set(_saved_names(path))
    cfg = model.config
    expected = set(_EXPECTED_SAVED)
    for i, lt in enumerate(cfg.layer_types):
        p = f"model.layers.{i}"
        expected |= {
            f"{p}.input_layernorm.weight",
            f"{p}.post_attention_layernorm.weight",
            f"{p}.attention.dense.weight",
        }
        if lt == _LIN:
            expected |= {f"{p}.attention.{x}" for x in ("q_conv1d.weight", "A_log", "dt_bias", "f_proj.weight")}
        else:
            expected |= {f"{p}.attention.kv_b_proj.weight", f"{p}.attention.g_proj.weight"}
        if cfg.mlp_layer_types[i] == "sparse":
            expected |= {
                f"{p}.mlp.gate.weight",
                f"{p}.mlp.gate.expert_bias",
                f"{p}.mlp.experts.0.gate_proj.weight",
                f"{p}.mlp.experts.{cfg.num_local_experts - 1}.down_proj.weight",
                f"{p}.mlp.shared_experts.up_proj.weight",
            }
        else:
            expected |= {f"{p}.mlp.gate_proj.weight"}
    missing = expected - names
    bad = [
        n
        for n in names
        if re.search(r"embed_tokens|self_attn|o_proj|forget_gate|e_score_correction|gate_up_proj|\.conv1d", n)
    ]
    if missing or bad:
        raise AssertionError(
            f"save_pretrained wrote unexpected names: missing={sorted(missing)[:8]} hf_names={bad[:8]}"
        )
    return path


def load_oracle(path, dtype=torch.float32) -> BailingHybridForCausalLM:
    """from_pretrained of an (unquantized, original-name) checkpoint dir, eager attention/experts, eval mode.

    Typical use for quantized-checkpoint tests: ``deq = make_quantized_checkpoint(src, q_dir)``, then
    ``write_hf_checkpoint(d, config, deq)`` and ``load_oracle(d)`` is the reference for what the quantized
    checkpoint should compute (the tiny oracles are chaotic: FP8/bf16 weight rounding alone moves logits by O(1))."""
    model = BailingHybridForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    )
    model.eval()
    model.requires_grad_(False)
    return model


def _saved_names(path: pathlib.Path) -> list[str]:
    idx = path / "model.safetensors.index.json"
    if idx.exists():
        return list(json.loads(idx.read_text())["weight_map"])
    from safetensors import safe_open

    names = []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            names += list(fh.keys())
    return names


def _ids(input_ids) -> torch.Tensor:
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)
    if ids.ndim == 1:
        ids = ids[None]
    return ids


@torch.no_grad()
def oracle_logits(model: BailingHybridForCausalLM, input_ids: np.ndarray) -> np.ndarray:
    """[B, T, V] float64 logits from one full forward (no cache)."""
    ids = _ids(input_ids)
    out = model(input_ids=ids, use_cache=False)
    return out.logits.to(torch.float64).cpu().numpy()


@torch.no_grad()
def oracle_router_choices(model: BailingHybridForCausalLM, input_ids) -> dict[int, np.ndarray]:
    """layer index -> [B*T, k] selected expert indices, sorted ascending per row (full forward, no cache)."""
    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import BailingHybridTopkRouter

    choices: dict[int, np.ndarray] = {}
    handles = []
    for mname, mod in model.named_modules():
        if isinstance(mod, BailingHybridTopkRouter):
            m = re.search(r"layers\.(\d+)\.mlp\.gate$", mname)
            assert m, mname
            layer = int(m.group(1))

            def hook(_mod, _inp, out, layer=layer):
                idx = out[2].detach().cpu().numpy().astype(np.int64)
                choices[layer] = np.sort(idx, axis=-1)

            handles.append(mod.register_forward_hook(hook))
    try:
        model(input_ids=_ids(input_ids), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return dict(sorted(choices.items()))


@torch.no_grad()
def oracle_cached_logits(model: BailingHybridForCausalLM, input_ids, prefill_len: int) -> np.ndarray:
    """HF prefill of the first ``prefill_len`` tokens (use_cache=True), then one token at a time with
    past_key_values. Returns the concatenated logits [B, T, V] float64."""
    ids = _ids(input_ids)
    B, T = ids.shape
    if not 1 <= prefill_len <= T:
        raise ValueError(f"prefill_len must be in [1, {T}], got {prefill_len}")
    pos = torch.arange(prefill_len, dtype=torch.long)[None].expand(B, -1)
    out = model(input_ids=ids[:, :prefill_len], position_ids=pos, use_cache=True)
    pkv = out.past_key_values
    logits = [out.logits.to(torch.float64)]
    for t in range(prefill_len, T):
        out = model(
            input_ids=ids[:, t : t + 1],
            position_ids=torch.full((B, 1), t, dtype=torch.long),
            past_key_values=pkv,
            use_cache=True,
        )
        pkv = out.past_key_values
        logits.append(out.logits.to(torch.float64))
    return torch.cat(logits, dim=1).cpu().numpy()
