"""ling_jax against the float64 NumPy reference (tests/support/np_reference.py) for what transformers lacks.

transformers' bailing_hybrid has no q-LoRA, no SwiGLU clipping, no NeoX RoPE, no MTP, no low-rank KDA gates and
no FP8 / MXFP4 loading, so those paths are checked here against np_reference instead. Every test writes a real
sharded HF-format checkpoint (original tensor names) with random weights, loads it with `load_hf_checkpoint` and
compares logits with np_reference.forward on the same (float32-rounded or dequantised) weights.
"""

from __future__ import annotations

import copy
import math

import jax.numpy as jnp
import ml_dtypes
import np_reference as npr
import numpy as np
import pytest
from checkpoint_factory import make_quantized_checkpoint, read_checkpoint_raw, write_hf_checkpoint
from flax import nnx

from ling_jax import load_hf_checkpoint

B = 2
T_SHORT = 37  # not a multiple of the KDA chunk (64)
T_LONG = 70  # crosses a KDA chunk boundary and exceeds YaRN's original length (32)
TOL_F32 = 1e-4
TOL_BF16 = 2e-2
MEANINGFUL = 1e-2  # a switched-off feature must move the reference logits at least this much

# inclusionAI config.json spelling. Uneven dims (v_head_dim != qk_nope_head_dim, kv_lora_rank != q_lora_rank,
# shared width 2 * Im) so that a transposed or mis-split weight cannot go unnoticed.
BASE = dict(
    vocab_size=97,
    hidden_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=12,  # KDA head dim
    q_lora_rank=24,
    kv_lora_rank=20,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    v_head_dim=10,
    num_experts=16,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=3,
    num_shared_experts=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    layer_group_size=2,  # [KDA, MLA, KDA, MLA]
    first_k_dense_replace=1,
    intermediate_size=80,
    moe_intermediate_size=24,
    short_conv_kernel_size=4,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    max_position_embeddings=4096,
    rope_interleave=True,
    no_kda_lora=True,
    kda_safe_gate=True,
    kda_lower_bound=-5.0,
    num_nextn_predict_layers=0,
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=1,
)


# Jitted: one compile per config (loaded models with equal configs share it) is cheaper on CPU than eager
# op-by-op dispatch, whose KDA scan is retraced on every call.
jax_forward = nnx.jit(lambda model, ids_BT: model(ids_BT))
jax_draft = nnx.jit(lambda model, hidden_BTD, next_ids_BT: model.draft_logits(hidden_BTD, next_ids_BT))


def config(**changes) -> dict:
    cfg = copy.deepcopy(BASE)
    cfg.update(copy.deepcopy(changes))
    return cfg


def rel_err(got, ref) -> float:
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def report(label: str, err: float) -> str:
    line = f"[reference parity] {label}: rel err {err:.3e}"
    print(line)
    return line


# ---------------------------------------------------------------------------------------------------------------
# Random checkpoints with the original tensor names (spec §6.1)
# ---------------------------------------------------------------------------------------------------------------


def layer_kinds(cfg: dict) -> list[tuple[str, str]]:
    """(attention, mlp) per main layer: MLA iff (i + 1) % g == 0, dense MLP for i < first_k_dense_replace."""
    g = cfg["layer_group_size"]
    return [
        ("mla" if (i + 1) % g == 0 else "kda", "dense" if i < cfg["first_k_dense_replace"] else "moe")
        for i in range(cfg["num_hidden_layers"])
    ]


def tensor_specs(cfg: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, kind) for every tensor of a checkpoint of `cfg`; kind picks the random distribution."""
    D, H, d, K = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"], cfg["short_conv_kernel_size"]
    C = H * d
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    rq, rkv = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    E, Im = cfg["num_experts"], cfg["moe_intermediate_size"]
    Is = cfg.get("moe_shared_expert_intermediate_size") or Im * cfg["num_shared_experts"]
    specs: dict[str, tuple[tuple[int, ...], str]] = {
        "model.word_embeddings.weight": ((cfg["vocab_size"], D), "embedding"),
        "model.norm.weight": ((D,), "norm"),
        "lm_head.weight": ((cfg["vocab_size"], D), "lm_head"),
    }

    def linear(name, out, inp, kind="linear"):
        specs[name] = ((out, inp), kind)

    def kda(p):
        for x in "qkv":
            linear(f"{p}.{x}_proj.weight", C, D)
            specs[f"{p}.{x}_conv1d.weight"] = ((C, 1, K), "conv")
        for x in "fg":
            if cfg["no_kda_lora"]:
                linear(f"{p}.{x}_proj.weight", C, D)
            else:
                linear(f"{p}.{x}_a_proj.weight", d, D)
                linear(f"{p}.{x}_b_proj.weight", C, d)
        linear(f"{p}.b_proj.weight", H, D)
        specs[f"{p}.A_log"] = ((H,), "A_log")
        specs[f"{p}.dt_bias"] = ((C,), "dt_bias")
        specs[f"{p}.o_norm.weight"] = ((d,), "norm")
        linear(f"{p}.dense.weight", D, C, "branch_out")

    def mla(p):
        if rq:
            linear(f"{p}.q_a_proj.weight", rq, D)
            specs[f"{p}.q_a_layernorm.weight"] = ((rq,), "norm")
            linear(f"{p}.q_b_proj.weight", H * (dn + dr), rq)
        else:
            linear(f"{p}.q_proj.weight", H * (dn + dr), D)
        linear(f"{p}.kv_a_proj_with_mqa.weight", rkv + dr, D)
        specs[f"{p}.kv_a_layernorm.weight"] = ((rkv,), "norm")
        linear(f"{p}.kv_b_proj.weight", H * (dn + dv), rkv)
        linear(f"{p}.g_proj.weight", H, D)
        linear(f"{p}.dense.weight", D, H * dv, "branch_out")

    def mlp(p, width):
        linear(f"{p}.gate_proj.weight", width, D)
        linear(f"{p}.up_proj.weight", width, D)
        linear(f"{p}.down_proj.weight", D, width, "branch_out")

    def moe(p):
        specs[f"{p}.gate.weight"] = ((E, D), "router")
        specs[f"{p}.gate.expert_bias"] = ((E,), "expert_bias")
        for e in range(E):
            mlp(f"{p}.experts.{e}", Im)
        mlp(f"{p}.shared_experts", Is)

    def layer(i, attention, ffn):
        p = f"model.layers.{i}"
        specs[f"{p}.input_layernorm.weight"] = ((D,), "norm")
        specs[f"{p}.post_attention_layernorm.weight"] = ((D,), "norm")
        (kda if attention == "kda" else mla)(f"{p}.attention")
        if ffn == "dense":
            mlp(f"{p}.mlp", cfg["intermediate_size"])
        else:
            moe(f"{p}.mlp")

    for i, (attention, ffn) in enumerate(layer_kinds(cfg)):
        layer(i, attention, ffn)
    if cfg["num_nextn_predict_layers"]:
        L = cfg["num_hidden_layers"]
        layer(L, "mla", "moe")
        for x in ("enorm", "hnorm", "final_layernorm"):
            specs[f"model.layers.{L}.{x}.weight"] = ((D,), "norm")
        linear(f"model.layers.{L}.eh_proj.weight", D, 2 * D)
    return specs


def random_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """float32 weights for every tensor, scaled so activations stay O(1) and nothing is left at a default.

    Residual-branch outputs (attention dense, down_proj) get half the gain of other projections, so a tiny
    perturbation is not amplified several-fold per layer as it is when every layer doubles the stream."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, (shape, kind) in tensor_specs(cfg).items():
        if kind == "embedding":
            w = rng.normal(0.0, 1.0, shape)
        elif kind == "lm_head":
            w = rng.normal(0.0, 2.0 / math.sqrt(shape[1]), shape)
        elif kind == "linear":
            w = rng.normal(0.0, 1.0 / math.sqrt(shape[1]), shape)
        elif kind == "branch_out":  # a layer adds about half the residual stream's size, not all of it
            w = rng.normal(0.0, 0.5 / math.sqrt(shape[1]), shape)
        elif kind == "norm":
            w = rng.uniform(0.7, 1.3, shape)
        elif kind == "conv":
            w = rng.normal(0.0, 0.5, shape)
        elif kind == "A_log":
            w = np.log(rng.uniform(0.5, 4.0, shape))
        elif kind == "dt_bias":  # safe gate: a negative shift spreads the decays instead of pinning them at e^-5
            w = rng.normal(-1.5 if cfg["kda_safe_gate"] else -0.5, 0.5, shape)
        elif kind == "router":  # decisive sigmoid scores
            w = rng.normal(0.0, 2.0 / math.sqrt(shape[1]), shape)
        elif kind == "expert_bias":
            w = rng.normal(0.0, 0.3, shape)
        else:
            raise AssertionError(kind)
        weights[name] = w.astype(np.float32)
    return weights


def random_ids(cfg: dict, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed + 1000).integers(0, cfg["vocab_size"], size=(B, length))


def ref_logits(weights, cfg, ids) -> np.ndarray:
    return npr.forward(weights, cfg, ids)["logits"]


class Case:
    """A written checkpoint, its float32 weights, the ids and the float64 reference."""

    def __init__(self, directory, cfg: dict, *, seed: int, length: int, num_shards: int = 4):
        self.directory, self.cfg = directory, cfg
        self.weights = random_weights(cfg, seed)
        write_hf_checkpoint(directory, cfg, self.weights, num_shards=num_shards)
        self.ids = random_ids(cfg, length, seed)
        self.ref = npr.forward(self.weights, cfg, self.ids)

    def load(self, dtype=jnp.float32):
        return load_hf_checkpoint(self.directory, dtype=dtype, progress=False)

    def check_logits(self, label: str, dtype=jnp.float32, tol: float = TOL_F32):
        model = self.load(dtype)
        out = jax_forward(model, jnp.asarray(self.ids))
        assert out.logits.shape == self.ref["logits"].shape
        err = rel_err(out.logits, self.ref["logits"])
        line = report(label, err)
        assert err <= tol, f"{line} > {tol}"
        return model, out


def assert_differs(label: str, a, b):
    """The feature under test must matter: switching it off moves the reference logits by > MEANINGFUL."""
    err = rel_err(a, b)
    line = report(f"{label} (sensitivity, must exceed {MEANINGFUL})", err)
    assert err > MEANINGFUL, f"{line}: the test would not notice this feature being ignored"


# ---------------------------------------------------------------------------------------------------------------
# 1 / 9. q-LoRA MLA, float32 and bfloat16
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qlora_case(tmp_path_factory):
    return Case(tmp_path_factory.mktemp("qlora"), config(), seed=1, length=T_SHORT)


def test_qlora_mla_logits(qlora_case):
    case = qlora_case
    assert "model.layers.1.attention.q_b_proj.weight" in case.weights
    # the expert bias is large enough to change which experts are picked (for O(1) normed inputs)
    x = np.random.default_rng(0).normal(size=(256, case.cfg["hidden_size"]))
    gate, bias = case.weights["model.layers.1.mlp.gate.weight"], case.weights["model.layers.1.mlp.gate.expert_bias"]
    with_bias, _ = npr.route(x, gate, bias, case.cfg)
    without_bias, _ = npr.route(x, gate, np.zeros_like(bias), case.cfg)
    changed = float(np.mean(np.any(with_bias != without_bias, axis=-1)))
    print(f"[reference parity] expert bias changes the selection of {changed:.0%} of tokens")
    assert changed > 0.2
    _, out = case.check_logits("q-LoRA MLA (float32)")
    err = rel_err(out.hidden, case.ref["hidden"])
    line = report("q-LoRA MLA final hidden (float32)", err)
    assert err <= TOL_F32, line


def pinned_router_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """random_weights whose expert biases (+3 on experts 0 and 1 of group 0 and expert 4 of group 1; sigmoid
    scores lie in (0, 1)) fix the selected groups and experts for every token, while the routing weights (the
    un-biased scores) still depend on the input."""
    weights = random_weights(cfg, seed)
    for name in weights:
        if name.endswith(".mlp.gate.expert_bias"):
            bias = np.zeros(cfg["num_experts"], np.float32)
            bias[[0, 1, 4]] = 3.0
            weights[name] = bias
    return weights


def test_qlora_mla_bfloat16(tmp_path):
    """The q-LoRA config in bfloat16. Expert selection is pinned: with data-dependent routing some top-k
    near-tie among the 2 x 37 x 3 choices flips under bf16 noise and moves that token's logits by O(1) (the
    float64 reference alone then moves 3-6% when only its weights are rounded to bf16)."""
    cfg = config()
    weights = pinned_router_weights(cfg, seed=1)
    write_hf_checkpoint(tmp_path, cfg, weights, num_shards=3)
    ids = random_ids(cfg, T_SHORT, seed=1)
    ref = ref_logits(weights, cfg, ids)
    model = load_hf_checkpoint(tmp_path, dtype=jnp.bfloat16, progress=False)
    assert model.model.layers[1].attention.q_b_proj.weight[...].dtype == jnp.bfloat16
    logits = jax_forward(model, jnp.asarray(ids)).logits
    keep_fp32 = ("A_log", "dt_bias", "conv1d", "expert_bias")
    rounded = {
        name: w if any(k in name for k in keep_fp32) else w.astype(ml_dtypes.bfloat16).astype(np.float32)
        for name, w in weights.items()
    }
    report(
        "q-LoRA MLA bf16 (context: float64 reference on bf16-rounded weights vs float32 weights)",
        rel_err(ref_logits(rounded, cfg, ids), ref),
    )
    err = rel_err(logits, ref)
    line = report("q-LoRA MLA (bfloat16 weights and activations)", err)
    assert err <= TOL_BF16, f"{line} > {TOL_BF16}"


# ---------------------------------------------------------------------------------------------------------------
# 2. SwiGLU clipping
# ---------------------------------------------------------------------------------------------------------------


def test_swiglu_clipping(tmp_path):
    # layers: 0 dense (its entries must be ignored: dense MLPs are never clipped), 1-3 MoE.
    # routed: 0 at layer 1 (no clip), 0.75 at layer 2, list too short for layer 3 (no clip).
    # shared: 1.0 at layer 1, null at layer 2 (no clip), 0.6 at layer 3.
    cfg = config(
        expert_swiglu_limit_list=[0.5, 0, 0.75],
        share_expert_swiglu_limit_list=[0.5, 1.0, None, 0.6],
        norm_topk_prob=False,
        q_lora_rank=None,
    )
    case = Case(tmp_path, cfg, seed=2, length=T_SHORT)
    for key in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
        unclipped = {k: v for k, v in cfg.items() if k != key}
        assert_differs(
            f"SwiGLU clipping, without {key}", ref_logits(case.weights, unclipped, case.ids), case.ref["logits"]
        )
    # a clipped dense layer 0 would be a bug: check the reference ignores index 0 (so the model must, too)
    dense_clip_free = config(
        **{**cfg, "expert_swiglu_limit_list": [0, 0, 0.75], "share_expert_swiglu_limit_list": [0, 1.0, None, 0.6]}
    )
    assert rel_err(ref_logits(case.weights, dense_clip_free, case.ids), case.ref["logits"]) == 0.0
    case.check_logits("SwiGLU clipping (per-layer limits, 0 / null / short list)")


# ---------------------------------------------------------------------------------------------------------------
# 3 / 4. YaRN and NeoX RoPE
# ---------------------------------------------------------------------------------------------------------------

YARN_VARIANTS = {
    "mscale-unset": {},
    "mscale-both-1": {"mscale": 1.0, "mscale_all_dim": 1.0},
    "mscale-unequal": {"mscale": 1.0, "mscale_all_dim": 0.5},
    "mscale-only": {"mscale": 0.707},
    "all-dim-only": {"mscale_all_dim": 0.8},
    "no-truncate-betas-attn-factor": {"beta_fast": 8, "beta_slow": 2, "truncate": False, "attn_factor": 0.9},
}


@pytest.mark.parametrize("variant", sorted(YARN_VARIANTS))
def test_yarn_rope(tmp_path, variant):
    rope_scaling = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        **YARN_VARIANTS[variant],
    }
    # 16 rope dims so the YaRN ramp has intermediate values; q_proj (no q-LoRA) for variety; one KDA and one MLA
    # layer (RoPE is the MLA's): half the layers to compile and to reference
    cfg = config(rope_scaling=rope_scaling, qk_rope_head_dim=16, q_lora_rank=None, num_hidden_layers=2)
    case = Case(tmp_path, cfg, seed=3, length=T_LONG)
    plain = {k: v for k, v in cfg.items() if k != "rope_scaling"}
    assert_differs(f"YaRN {variant} vs plain RoPE", ref_logits(case.weights, plain, case.ids), case.ref["logits"])
    case.check_logits(f"YaRN {variant}")


@pytest.mark.parametrize("yarn", [False, True], ids=["plain", "yarn"])
def test_neox_rope(tmp_path, yarn):
    changes = dict(
        rope_interleave=False,
        qk_rope_head_dim=16,
        n_group=0,
        topk_group=0,
        moe_shared_expert_intermediate_size=40,
        num_hidden_layers=2,  # [KDA, MLA]: the MLA layer's RoPE, and an MoE layer for the ungrouped routing
    )
    if yarn:
        changes["rope_scaling"] = {
            "rope_type": "deepseek_yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        }
    cfg = config(**changes)
    case = Case(tmp_path, cfg, seed=4, length=T_LONG)
    assert_differs(
        "NeoX vs interleaved RoPE",
        ref_logits(case.weights, {**cfg, "rope_interleave": True}, case.ids),
        case.ref["logits"],
    )
    case.check_logits(f"NeoX RoPE ({'yarn' if yarn else 'plain'})")


# ---------------------------------------------------------------------------------------------------------------
# 5. MTP draft logits
# ---------------------------------------------------------------------------------------------------------------


def test_mtp_draft_logits(tmp_path):
    L = BASE["num_hidden_layers"]
    # index 0 is a dense layer in the main model, so its limits act only on the MTP layer (spec §5: SGLang's
    # MTP MoE uses index 0); index L = 4 holds different limits that a wrong lookup would pick up.
    cfg = config(
        num_nextn_predict_layers=1,
        expert_swiglu_limit_list=[0.6, 3.0, 2.0, 1.5, 0],
        share_expert_swiglu_limit_list=[0.5, 2.5, 0, 1.5, 4.0],
    )
    case = Case(tmp_path, cfg, seed=5, length=T_SHORT)
    next_ids = random_ids(cfg, T_SHORT, seed=55)
    ref_draft = npr.mtp_draft_logits(case.weights, cfg, case.ref["hidden"], next_ids)
    wrong_index = {
        **cfg,
        "expert_swiglu_limit_list": [0, 3.0, 2.0, 1.5, 0],
        "share_expert_swiglu_limit_list": [4.0, 2.5, 0, 1.5, 4.0],
    }
    assert_differs(
        "MTP clip index 0 vs index L",
        npr.mtp_draft_logits(case.weights, wrong_index, case.ref["hidden"], next_ids),
        ref_draft,
    )
    assert rel_err(ref_logits(case.weights, wrong_index, case.ids), case.ref["logits"]) == 0.0
    assert f"model.layers.{L}.eh_proj.weight" in case.weights
    model, out = case.check_logits("MTP checkpoint, main logits")
    err = rel_err(jax_draft(model, out.hidden, jnp.asarray(next_ids)).logits, ref_draft)
    line = report("MTP draft logits", err)
    assert err <= TOL_F32, line


# ---------------------------------------------------------------------------------------------------------------
# 6. Low-rank KDA gates and the softplus gate
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "no_kda_lora,safe_gate",
    [(False, True), (True, False), (False, False)],
    ids=["lora-safe", "fullrank-softplus", "lora-softplus"],
)
def test_kda_gate_variants(tmp_path, no_kda_lora, safe_gate):
    cfg = config(no_kda_lora=no_kda_lora, kda_safe_gate=safe_gate, kda_lower_bound=-3.0 if safe_gate else -5.0)
    case = Case(tmp_path, cfg, seed=6, length=T_LONG)
    if not no_kda_lora:
        assert case.weights["model.layers.0.attention.f_a_proj.weight"].shape == (cfg["head_dim"], cfg["hidden_size"])
        assert "model.layers.0.attention.f_proj.weight" not in case.weights
    other_gate = {**cfg, "kda_safe_gate": not safe_gate}
    assert_differs("KDA safe vs softplus gate", ref_logits(case.weights, other_gate, case.ids), case.ref["logits"])
    if safe_gate:
        assert_differs(
            "KDA lower bound -3 vs -5",
            ref_logits(case.weights, {**cfg, "kda_lower_bound": -5.0}, case.ids),
            case.ref["logits"],
        )
    case.check_logits(f"KDA gates (no_kda_lora={no_kda_lora}, kda_safe_gate={safe_gate})")


# ---------------------------------------------------------------------------------------------------------------
# 7 / 8. Quantized checkpoints: block FP8 and MXFP4 routed experts
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def oracle_dir(tmp_path_factory):
    pytest.importorskip("torch")
    from oracle import build_oracle, save_oracle

    return save_oracle(build_oracle("g4_wide", seed=0), tmp_path_factory.mktemp("oracle_g4_wide"))


def reference_dequantised(directory) -> tuple[dict, dict[str, np.ndarray], dict[str, int]]:
    """(config, name -> float64, count per storage kind) from the raw stored tensors, dequantised with
    np_reference (not with the factory's own dequantisation)."""
    cfg, raw = read_checkpoint_raw(directory)
    block = cfg["quantization_config"]["weight_block_size"]
    fp8 = np.dtype(ml_dtypes.float8_e4m3fn)
    weights = {}
    kinds = {"fp8": 0, "mxfp4": 0, "plain": 0}
    for name, stored in raw.items():
        if name.endswith("_scale_inv"):
            continue
        scale = raw.get(name + "_scale_inv")
        if stored.dtype == fp8:
            assert scale is not None, name
            weights[name] = npr.dequant_fp8_block(stored, scale, block)
            kinds["fp8"] += 1
        elif stored.dtype in (np.uint8, np.int8):
            assert scale is not None, name
            weights[name] = npr.dequant_mxfp4(stored, scale)
            kinds["mxfp4"] += 1
        else:
            assert scale is None, name
            weights[name] = stored.astype(np.float64)
            kinds["plain"] += 1
    return cfg, weights, kinds


def check_quantized(src, dst, label, *, stored_dtypes=None, **quant_kwargs):
    """stored_dtypes: (packed, scale) dtypes that routed expert 0 of layer 1 must be stored with."""
    expected = make_quantized_checkpoint(src, dst, **quant_kwargs)
    if stored_dtypes is not None:
        _, raw = read_checkpoint_raw(dst)
        expert = "model.layers.1.mlp.experts.0.down_proj.weight"
        assert (raw[expert].dtype, raw[expert + "_scale_inv"].dtype) == tuple(map(np.dtype, stored_dtypes))
    cfg, weights, kinds = reference_dequantised(dst)
    print(f"[reference parity] {label}: stored tensors {kinds}")
    assert kinds["fp8"] > 0 and (kinds["mxfp4"] > 0) == bool(quant_kwargs.get("mxfp4_experts"))
    assert set(weights) == set(expected)
    for name, value in expected.items():  # the factory and np_reference agree on every dequantised weight
        # the factory multiplies in float32, np_reference in float64: equal up to one float32 rounding
        np.testing.assert_allclose(weights[name], value, rtol=2e-7, atol=0, err_msg=name)
    ids = random_ids(cfg, T_SHORT, seed=7)
    ref = npr.forward(weights, cfg, ids)["logits"]
    model = load_hf_checkpoint(dst, dtype=jnp.float32, progress=False)
    err = rel_err(jax_forward(model, jnp.asarray(ids)).logits, ref)
    line = report(label, err)
    assert err <= TOL_F32, f"{line} > {TOL_F32}"


@pytest.mark.parametrize("block", [(128, 128), (16, 16)], ids=["block128", "block16"])
def test_fp8_checkpoint(oracle_dir, tmp_path, block):
    check_quantized(oracle_dir, tmp_path, f"FP8 {block[0]}x{block[1]} blocks", block=block)


SCALE_DTYPES = {"float32": np.float32, "e8m0": ml_dtypes.float8_e8m0fnu, "uint8": np.uint8}


@pytest.mark.parametrize("scale_format,packed_dtype", [("float32", "uint8"), ("e8m0", "uint8"), ("uint8", "int8")])
def test_mxfp4_experts(oracle_dir, tmp_path, scale_format, packed_dtype):
    # g4_wide: Im = 144, so down_proj [160, 144] ends in a partial 16-element MXFP4 group
    check_quantized(
        oracle_dir,
        tmp_path,
        f"FP8 + MXFP4 experts (scales {scale_format}, packed {packed_dtype})",
        stored_dtypes=(packed_dtype, SCALE_DTYPES[scale_format]),
        mxfp4_experts=True,
        mxfp4_scale_format=scale_format,
        mxfp4_packed_dtype=packed_dtype,
    )
