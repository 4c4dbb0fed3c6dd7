"""Validate the float64 NumPy reference (tests/support/np_reference.py) against transformers'
BailingHybridForCausalLM (fp32, CPU) and against hand-built examples for what HF lacks."""

from __future__ import annotations

import copy
import json
import math
import os
import sys

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import np_reference as npr  # noqa: E402
from optional_deps import from_transformers  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file  # noqa: E402

B, T = 2, 37
TOL = 1e-4


def rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ----------------------------------------------------------------------------------------------
# Oracle construction
# ----------------------------------------------------------------------------------------------

LIN, FULL = "linear_attention", "full_attention"

CFG_A = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,  # KDA head dim (HF turns it into linear_head_dim)
    qk_rope_head_dim=8,
    qk_nope_head_dim=12,
    v_head_dim=10,
    kv_lora_rank=24,
    num_experts=16,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=3,
    n_shared_experts=2,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    rms_norm_eps=1e-6,
    num_mtp_layers=0,
    pad_token_id=0,
    eos_token_id=1,
    short_conv_kernel_size=4,
    layer_types=[LIN, FULL, LIN, LIN, FULL],
    rope_theta=10000.0,
    kda_safe_gate=True,
    kda_lower_bound=-5.0,
)

CFG_B = dict(
    CFG_A,
    num_hidden_layers=4,
    layer_types=[FULL, LIN, FULL, LIN],
    first_k_dense_replace=2,
    topk_group=3,
    num_experts_per_tok=4,
    n_shared_experts=1,
    norm_topk_prob=False,
    kda_safe_gate=False,
    max_position_embeddings=1024,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
)
CFG_B.pop("rope_theta")


def _randomise(model, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(*shape, generator=gen)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(randn(p.shape) * 0.7)
            elif "conv1d" in name:
                p.copy_(randn(p.shape) * 0.5)
            elif p.ndim == 1:  # every RMSNorm weight (incl. o_norm, kv_a_layernorm, model.norm)
                p.copy_(1.0 + 0.3 * randn(p.shape))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(randn(p.shape))
            elif name.endswith("mlp.gate.weight"):  # router: spread the sigmoid scores
                p.copy_(randn(p.shape) * (1.5 / math.sqrt(p.shape[-1])))
            else:
                p.copy_(randn(p.shape) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(randn(b.shape) * 0.3)


def _build(tmp_dir, cfg_kwargs, seed):
    """Run the HF oracle, save it, and return (weights, saved config dict, ids, hf logits, hf hidden)."""
    BailingHybridConfig, BailingHybridForCausalLM = from_transformers(
        "transformers", "BailingHybridConfig", "BailingHybridForCausalLM"
    )

    torch.manual_seed(seed)
    cfg = BailingHybridConfig(**copy.deepcopy(cfg_kwargs))
    cfg._attn_implementation = "eager"
    model = BailingHybridForCausalLM(cfg).eval().float()
    _randomise(model, seed)
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, cfg.vocab_size, size=(B, T))
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids), use_cache=False)
        hid = model.model(input_ids=torch.from_numpy(ids), use_cache=False).last_hidden_state
    model.save_pretrained(tmp_dir)
    weights = load_file(os.path.join(tmp_dir, "model.safetensors"))
    with open(os.path.join(tmp_dir, "config.json")) as f:
        config = json.load(f)
    return dict(weights=weights, config=config, ids=ids, logits=out.logits.numpy(), hidden=hid.numpy(), model=model)


@pytest.fixture(scope="module")
def oracle_a(tmp_path_factory):
    return _build(str(tmp_path_factory.mktemp("hf_a")), CFG_A, seed=0)


@pytest.fixture(scope="module")
def oracle_b(tmp_path_factory):
    return _build(str(tmp_path_factory.mktemp("hf_b")), CFG_B, seed=1)


@pytest.fixture(scope="module")
def ref_a(oracle_a):
    return npr.forward(oracle_a["weights"], oracle_a["config"], oracle_a["ids"])


# ----------------------------------------------------------------------------------------------
# Against the HF oracle
# ----------------------------------------------------------------------------------------------


def test_saved_checkpoint_uses_original_names(oracle_a):
    w, c = oracle_a["weights"], oracle_a["config"]
    assert "model.word_embeddings.weight" in w
    assert "model.layers.0.attention.q_conv1d.weight" in w and w["model.layers.0.attention.q_conv1d.weight"].shape == (
        64,
        1,
        4,
    )
    assert "model.layers.1.attention.dense.weight" in w
    assert "model.layers.1.mlp.experts.15.gate_proj.weight" in w
    assert "model.layers.1.mlp.gate.expert_bias" in w
    # the saved config uses the transformers spelling that np_reference must understand
    assert c["head_dim"] == 8 and c["linear_head_dim"] == 16
    assert c["layer_types"] == CFG_A["layer_types"]


def _check_forward(ref, oracle, label: str) -> None:
    """The reference's logits and last hidden states within TOL of the oracle's."""
    e_logits = rel_err(ref["logits"], oracle["logits"])
    e_hidden = rel_err(ref["hidden"], oracle["hidden"])
    print(f"\n[{label}] logits rel err {e_logits:.3e}, hidden rel err {e_hidden:.3e}")
    assert e_logits <= TOL
    assert e_hidden <= TOL


def test_forward_matches_hf(oracle_a, ref_a):
    assert ref_a["logits"].shape == (B, T, 97) and ref_a["logits"].dtype == np.float64
    assert ref_a["hidden"].shape == (B, T, 64) and ref_a["hidden"].dtype == np.float64
    _check_forward(ref_a, oracle_a, "config A")


def test_forward_matches_hf_yarn_softplus_gate_no_renorm(oracle_b):
    ref = npr.forward(oracle_b["weights"], oracle_b["config"], oracle_b["ids"])
    _check_forward(ref, oracle_b, "config B: yarn, softplus gate, no renorm")


def test_yarn_params_match_hf(oracle_b):
    """inv_freq / cos-sin factor / softmax scale equal HF's yarn init and MLA scaling."""
    model = oracle_b["model"]
    inv_freq, cs, scale = npr.rope_inv_freq_and_mscale(oracle_b["config"])
    rot = model.model.rotary_emb
    np.testing.assert_allclose(inv_freq, rot.inv_freq.double().numpy(), rtol=1e-6)
    assert abs(cs - rot.attention_scaling) < 1e-6
    assert abs(scale - model.model.layers[0].self_attn.scaling) < 1e-7
    f = 4.0
    assert abs(cs - (0.1 * math.log(f) + 1) / (0.05 * math.log(f) + 1)) < 1e-12
    assert abs(scale - (0.05 * math.log(f) + 1) ** 2 / math.sqrt(20)) < 1e-12
    # the ramp is non-trivial in this config (some frequencies interpolated, some kept)
    base = 10000.0 ** (-np.arange(4) * 2 / 8)
    ratio = inv_freq / base
    assert ratio.max() == pytest.approx(1.0) and ratio.min() == pytest.approx(1 / f)


def test_router_matches_hf_and_bias_matters(oracle_a):
    model, w, cfg = oracle_a["model"], oracle_a["weights"], oracle_a["config"]
    rng = np.random.default_rng(5)
    x = rng.standard_normal((200, 64))
    gate = model.model.layers[2].mlp.gate
    with torch.no_grad():
        _, hw, hi = gate(torch.from_numpy(x).float())
    order = torch.argsort(hi, dim=-1)
    hi = torch.gather(hi, 1, order).numpy()
    hw = torch.gather(hw, 1, order).numpy()
    W = w["model.layers.2.mlp.gate.weight"]
    bias = w["model.layers.2.mlp.gate.expert_bias"]
    idx, wts = npr.route(x, W, bias, cfg)
    assert idx.shape == (200, 3) and np.all(np.diff(idx, axis=-1) > 0)
    np.testing.assert_array_equal(idx, hi)
    np.testing.assert_allclose(wts, hw, rtol=1e-5, atol=1e-6)
    # sum of renormalised weights == routed_scaling_factor
    np.testing.assert_allclose(wts.sum(-1), 2.5, rtol=1e-12)
    # the expert bias changes the selection for a good share of tokens (so the test can fail)
    idx0, _ = npr.route(x, W, np.zeros_like(bias), cfg)
    assert np.mean(np.any(idx0 != idx, axis=-1)) > 0.2
    # group limiting is active: selected experts span at most topk_group groups
    assert np.all([len(set(r // 4)) <= 2 for r in idx])
    cfg_nogroup = dict(cfg, num_expert_group=0)
    idx_ng, _ = npr.route(x, W, bias, cfg_nogroup)
    assert np.any(idx_ng != idx)


def _to_inclusionai_spelling(c: dict) -> dict:
    """Rewrite a save_pretrained config.json into inclusionAI's spelling."""
    c = copy.deepcopy(c)
    c["head_dim"] = c.pop("linear_head_dim")
    for k in ("linear_num_heads", "linear_conv_kernel_dim", "qk_head_dim"):
        c.pop(k, None)
    c["layer_group_size"] = [1 if t == LIN else 0 for t in c.pop("layer_types")]
    c.pop("mlp_layer_types")
    c["num_experts_per_tok"] = c.pop("num_experts_per_token")
    c["n_group"] = c.pop("num_expert_group")
    c["norm_topk_prob"] = c.pop("moe_renormalize")
    c["max_position_embeddings"] = c.pop("model_max_length")
    rp = c.pop("rope_parameters")
    c["rope_theta"] = rp.pop("rope_theta")
    c["rope_scaling"] = rp if rp.get("rope_type", "default") != "default" else None
    c["n_shared_experts"] = c.pop("num_shared_experts")
    return c


def test_inclusionai_config_spelling(oracle_a, oracle_b, ref_a):
    for orc, ref in ((oracle_a, ref_a), (oracle_b, None)):
        if ref is None:
            ref = npr.forward(orc["weights"], orc["config"], orc["ids"])
        c2 = _to_inclusionai_spelling(orc["config"])
        out = npr.forward(orc["weights"], c2, orc["ids"])
        np.testing.assert_array_equal(out["logits"], ref["logits"])
    # int layer_group_size: (i+1) % g == 0 -> MLA
    c = _to_inclusionai_spelling(oracle_a["config"])
    assert npr._layer_is_kda(dict(c, layer_group_size=3)) == [True, True, False, True, True]
    assert npr._layer_is_kda(dict(c, layer_group_size=0)) == [False] * 5


# ----------------------------------------------------------------------------------------------
# Self-consistency checks for features HF lacks
# ----------------------------------------------------------------------------------------------


def _mla_layers(cfg):
    return [i for i, t in enumerate(cfg["layer_types"]) if t == FULL]


def _kda_layers(cfg):
    return [i for i, t in enumerate(cfg["layer_types"]) if t == LIN]


def test_causality(oracle_a, ref_a):
    ids = oracle_a["ids"].copy()
    ids[0, 20] = (ids[0, 20] + 7) % 97
    out = npr.forward(oracle_a["weights"], oracle_a["config"], ids)["logits"]
    np.testing.assert_allclose(out[:, :20], ref_a["logits"][:, :20], rtol=0, atol=1e-12)
    np.testing.assert_allclose(out[1], ref_a["logits"][1], rtol=0, atol=1e-12)
    assert np.abs(out[0, 20:] - ref_a["logits"][0, 20:]).min(axis=-1).max() > 0
    assert rel_err(out[0, 20:], ref_a["logits"][0, 20:]) > 1e-3


def test_neox_rope_equals_permuted_interleaved(oracle_a, ref_a):
    """Reordering the rope rows [0,2,4,..,1,3,5,..] turns interleaved pairs into NeoX halves."""
    cfg, w = oracle_a["config"], dict(oracle_a["weights"])
    dn, dr, H, R = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["num_attention_heads"], cfg["kv_lora_rank"]
    perm = np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)])
    for i in _mla_layers(cfg):
        p = f"model.layers.{i}.attention."
        q = w[p + "q_proj.weight"].reshape(H, dn + dr, -1).copy()
        q[:, dn:] = q[:, dn:][:, perm]
        w[p + "q_proj.weight"] = q.reshape(H * (dn + dr), -1)
        kv = w[p + "kv_a_proj_with_mqa.weight"].copy()
        kv[R:] = kv[R:][perm]
        w[p + "kv_a_proj_with_mqa.weight"] = kv
    out = npr.forward(w, dict(cfg, rope_interleave=False), oracle_a["ids"])["logits"]
    assert rel_err(out, ref_a["logits"]) < 1e-11
    # ... while using the permuted weights with interleaved RoPE does differ
    out_bad = npr.forward(w, cfg, oracle_a["ids"])["logits"]
    assert rel_err(out_bad, ref_a["logits"]) > 1e-4


def test_q_lora_path(oracle_a, ref_a):
    """q_a_proj = I, q_a_layernorm = c, q_b_proj = q_proj / c reproduces the q_proj path when the MLA
    input_layernorm weight is 1 (then RMSNorm(x) == x up to eps)."""
    cfg, w0 = oracle_a["config"], dict(oracle_a["weights"])
    D = cfg["hidden_size"]
    for i in _mla_layers(cfg):
        w0[f"model.layers.{i}.input_layernorm.weight"] = np.ones(D, np.float32)
    ref = npr.forward(w0, cfg, oracle_a["ids"])["logits"]
    w = dict(w0)
    c = 1.7
    for i in _mla_layers(cfg):
        p = f"model.layers.{i}.attention."
        qp = w.pop(p + "q_proj.weight").astype(np.float64)
        w[p + "q_a_proj.weight"] = np.eye(D)
        w[p + "q_a_layernorm.weight"] = np.full(D, c)
        w[p + "q_b_proj.weight"] = qp / c
    out = npr.forward(w, dict(cfg, q_lora_rank=D), oracle_a["ids"])["logits"]
    assert rel_err(out, ref) < 1e-5
    w_bad = dict(w)
    for i in _mla_layers(cfg):
        w_bad[f"model.layers.{i}.attention.q_a_layernorm.weight"] = np.full(D, 1.0)
    out_bad = npr.forward(w_bad, dict(cfg, q_lora_rank=D), oracle_a["ids"])["logits"]
    assert rel_err(out_bad, ref) > 1e-3


def test_kda_low_rank_gates(oracle_a):
    cfg, w = oracle_a["config"], dict(oracle_a["weights"])
    D, d, H = cfg["hidden_size"], cfg["linear_head_dim"], cfg["num_attention_heads"]
    rng = np.random.default_rng(3)
    w_lr = dict(w)
    for i in _kda_layers(cfg):
        p = f"model.layers.{i}.attention."
        for n in ("f", "g"):
            a = rng.standard_normal((d, D)) / math.sqrt(D)
            b = rng.standard_normal((H * d, d)) / math.sqrt(d)
            w_lr.pop(p + f"{n}_proj.weight")
            w_lr[p + f"{n}_a_proj.weight"] = a
            w_lr[p + f"{n}_b_proj.weight"] = b
            w[p + f"{n}_proj.weight"] = b @ a
    out_lr = npr.forward(w_lr, cfg, oracle_a["ids"])["logits"]
    out_full = npr.forward(w, cfg, oracle_a["ids"])["logits"]
    assert rel_err(out_lr, out_full) < 1e-12


def test_kda_gate_variants(oracle_a, ref_a):
    cfg = oracle_a["config"]
    w = oracle_a["weights"]
    out_lb = npr.forward(w, dict(cfg, kda_lower_bound=-2.0), oracle_a["ids"])["logits"]
    out_sp = npr.forward(w, dict(cfg, kda_safe_gate=False), oracle_a["ids"])["logits"]
    assert rel_err(out_lb, ref_a["logits"]) > 1e-3
    assert rel_err(out_sp, ref_a["logits"]) > 1e-3
    # defaults when the keys are absent: safe gate with bound -5
    c = {k: v for k, v in cfg.items() if k not in ("kda_safe_gate", "kda_lower_bound")}
    np.testing.assert_array_equal(npr.forward(w, c, oracle_a["ids"])["logits"], ref_a["logits"])


def test_swiglu_clip_unit():
    a = np.array([-1.0, 0.0, 3.0, 0.5])
    u = np.array([5.0, -5.0, 0.5, -3.0])
    got = npr._swiglu(a, u, 2.0)
    silu = a / (1 + np.exp(-a))
    want = np.array([silu[0] * 2.0, 0.0, 2.0 * 0.5, silu[3] * -2.0])
    np.testing.assert_allclose(got, want, rtol=1e-15)
    np.testing.assert_allclose(npr._swiglu(a, u, None), silu * u, rtol=1e-15)


def test_swiglu_limits_per_layer(oracle_a, ref_a):
    cfg, w, ids = oracle_a["config"], oracle_a["weights"], oracle_a["ids"]
    L = cfg["num_hidden_layers"]
    run = lambda **kw: npr.forward(w, dict(cfg, **kw), ids)["logits"]  # noqa: E731
    # huge limit / zero / None / too-short list -> no clipping
    np.testing.assert_array_equal(
        run(expert_swiglu_limit_list=[1e9] * L, share_expert_swiglu_limit_list=[1e9] * L), ref_a["logits"]
    )
    np.testing.assert_array_equal(
        run(expert_swiglu_limit_list=[0] * L, share_expert_swiglu_limit_list=[None] * L), ref_a["logits"]
    )
    np.testing.assert_array_equal(run(expert_swiglu_limit_list=[0.0, 0.0]), ref_a["logits"])
    # dense layer 0 is never clipped
    np.testing.assert_array_equal(
        run(expert_swiglu_limit_list=[0.05] + [0] * (L - 1), share_expert_swiglu_limit_list=[0.05] + [0] * (L - 1)),
        ref_a["logits"],
    )
    # small limits on a MoE layer change the output; routed and shared limits act separately
    r = run(expert_swiglu_limit_list=[0, 0, 0.05, 0, 0])
    s = run(share_expert_swiglu_limit_list=[0, 0, 0.05, 0, 0])
    assert rel_err(r, ref_a["logits"]) > 1e-3
    assert rel_err(s, ref_a["logits"]) > 1e-3
    assert rel_err(r, s) > 1e-3
    # index L does not exist in the main model (only the MTP layer is numbered L) -> no clipping
    np.testing.assert_array_equal(run(expert_swiglu_limit_list=[0] * L + [0.05]), ref_a["logits"])


def test_shared_expert_width_rule(oracle_a, ref_a):
    """Shared width = moe_shared_expert_intermediate_size if present else Im * num_shared_experts (= 64 here)."""
    w, c, ids = oracle_a["weights"], oracle_a["config"], oracle_a["ids"][:, :4]
    assert w["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (64, 64)
    out = npr.forward(w, dict(c, moe_shared_expert_intermediate_size=64), ids)
    np.testing.assert_allclose(out["logits"], ref_a["logits"][:, :4], rtol=1e-12, atol=1e-12)
    with pytest.raises(AssertionError):
        npr.forward(w, dict(c, moe_shared_expert_intermediate_size=32), ids)
    with pytest.raises(AssertionError):
        npr.forward(w, dict(c, num_shared_experts=1), ids)


def _with_mtp(oracle, seed=11):
    """Add an MTP layer at index L: copy of the last (MLA+MoE) layer plus random enorm/hnorm/eh_proj."""
    cfg, w = oracle["config"], dict(oracle["weights"])
    L, D = cfg["num_hidden_layers"], cfg["hidden_size"]
    src = max(_mla_layers(cfg))
    rng = np.random.default_rng(seed)
    for k in list(oracle["weights"]):
        pre = f"model.layers.{src}."
        if k.startswith(pre):
            v = np.asarray(w[k], np.float64)
            if v.ndim == 1 and "norm" in k:
                v = v * (1 + 0.1 * rng.standard_normal(v.shape))
            w[f"model.layers.{L}." + k[len(pre) :]] = v
    w[f"model.layers.{L}.enorm.weight"] = 1 + 0.3 * rng.standard_normal(D)
    w[f"model.layers.{L}.hnorm.weight"] = 1 + 0.3 * rng.standard_normal(D)
    w[f"model.layers.{L}.final_layernorm.weight"] = 1 + 0.3 * rng.standard_normal(D)
    w[f"model.layers.{L}.eh_proj.weight"] = rng.standard_normal((D, 2 * D)) / math.sqrt(2 * D)
    return cfg, w


def test_mtp_draft_logits(oracle_a, ref_a):
    cfg, w = _with_mtp(oracle_a)
    L, D, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    hidden = ref_a["hidden"]
    next_ids = np.concatenate([oracle_a["ids"][:, 1:], np.full((B, 1), 5)], axis=1)
    got = npr.mtp_draft_logits(w, cfg, hidden, next_ids)
    assert got.shape == (B, T, V) and got.dtype == np.float64

    # Independent composition: z = eh_proj [enorm(e); hnorm(h)], then a 1-layer model whose only
    # layer is the MTP decoder layer, fed z through a per-position embedding table.
    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg["rms_norm_eps"]) * g

    e = np.asarray(w["model.word_embeddings.weight"], np.float64)[next_ids]
    z = np.concatenate(
        [rms(e, w[f"model.layers.{L}.enorm.weight"]), rms(hidden, w[f"model.layers.{L}.hnorm.weight"])], -1
    )
    z = z @ w[f"model.layers.{L}.eh_proj.weight"].T
    w1 = {
        k.replace(f"model.layers.{L}.", "model.layers.0."): v
        for k, v in w.items()
        if k.startswith(f"model.layers.{L}.")
    }
    w1["model.word_embeddings.weight"] = z.reshape(B * T, D)
    w1["model.norm.weight"] = w[f"model.layers.{L}.final_layernorm.weight"]
    w1["lm_head.weight"] = w["lm_head.weight"]
    cfg1 = dict(cfg, num_hidden_layers=1, layer_types=[FULL], mlp_layer_types=["sparse"])
    want = npr.forward(w1, cfg1, np.arange(B * T).reshape(B, T))["logits"]
    assert rel_err(got, want) < 1e-12

    # causal over positions
    h2 = hidden.copy()
    h2[:, 30] += 1.0
    got2 = npr.mtp_draft_logits(w, cfg, h2, next_ids)
    np.testing.assert_array_equal(got2[:, :30], got[:, :30])
    assert rel_err(got2[:, 30:], got[:, 30:]) > 1e-4

    # clip limits for the MTP MoE come from index 0 of the lists (SGLang), not index L
    lim_L = [0] * L + [0.05]
    np.testing.assert_array_equal(
        npr.mtp_draft_logits(w, dict(cfg, expert_swiglu_limit_list=lim_L), hidden, next_ids), got
    )
    lim_0 = [0.05] + [0] * L
    assert rel_err(npr.mtp_draft_logits(w, dict(cfg, expert_swiglu_limit_list=lim_0), hidden, next_ids), got) > 1e-3


def test_tied_lm_head(oracle_a):
    w = dict(oracle_a["weights"])
    w.pop("lm_head.weight")
    with pytest.raises(KeyError):
        npr.forward(w, oracle_a["config"], oracle_a["ids"][:, :4])
    out = npr.forward(w, dict(oracle_a["config"], tie_word_embeddings=True), oracle_a["ids"][:, :4])
    np.testing.assert_allclose(out["logits"], out["hidden"] @ w["model.word_embeddings.weight"].astype(np.float64).T)


# ----------------------------------------------------------------------------------------------
# RoPE / YaRN numbers from the spec
# ----------------------------------------------------------------------------------------------


def test_yarn_spec_example():
    cfg = dict(
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        rope_theta=6e6,
        rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 131072},
    )
    inv_freq, cs, scale = npr.rope_inv_freq_and_mscale(cfg)
    assert inv_freq.shape == (32,)
    assert cs == pytest.approx(1.0693147, abs=1e-7)
    assert scale == pytest.approx(1 / math.sqrt(192), rel=1e-12)
    base = 6e6 ** (-np.arange(32) * 2 / 64)
    ratio = inv_freq / base
    lo, hi = 13, 21  # spec §3.3 example
    np.testing.assert_allclose(ratio[: lo + 1], 1.0, rtol=1e-12)
    np.testing.assert_allclose(ratio[hi:], 0.5, rtol=1e-12)
    ramp = (np.arange(lo + 1, hi) - lo) / (hi - lo)
    np.testing.assert_allclose(ratio[lo + 1 : hi], (1 - ramp) + ramp / 2, rtol=1e-12)
    # rope_parameters spelling with rope_theta inside; mscale_all_dim sets the softmax scale
    cfg2 = dict(
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        rope_parameters=dict(cfg["rope_scaling"], rope_theta=6e6, mscale=1.0, mscale_all_dim=1.0),
    )
    inv2, cs2, scale2 = npr.rope_inv_freq_and_mscale(cfg2)
    np.testing.assert_array_equal(inv2, inv_freq)
    assert cs2 == pytest.approx(1.0)
    assert scale2 == pytest.approx((0.1 * math.log(2) + 1) ** 2 / math.sqrt(192), rel=1e-12)
    # plain RoPE (factor absent / 1 / default type)
    inv3, cs3, scale3 = npr.rope_inv_freq_and_mscale(dict(qk_rope_head_dim=64, qk_nope_head_dim=128, rope_theta=6e6))
    np.testing.assert_allclose(inv3, base, rtol=1e-15)
    assert cs3 == 1.0 and scale3 == pytest.approx(1 / math.sqrt(192))


# ----------------------------------------------------------------------------------------------
# Dequantisation
# ----------------------------------------------------------------------------------------------


def test_dequant_fp8_block_partial_edges():
    # 5 x 7 weight, 2 x 3 blocks -> scale grid 3 x 3 with partial last row/column blocks
    vals = np.array(
        [
            [1.0, -2.0, 0.5, 3.0, -0.25, 1.5, 448.0],
            [0.75, 6.0, -1.0, 2.5, 4.0, -3.5, 0.125],
            [-8.0, 1.25, 2.0, -0.5, 10.0, 12.0, -1.75],
            [0.0625, -0.375, 7.0, 1.0, -6.0, 0.5, 2.0],
            [3.0, 0.25, -4.0, 5.0, 1.0, -2.0, 0.875],
        ]
    )
    fp8 = vals.astype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(fp8.astype(np.float64), vals)  # all exactly representable
    scale = np.array([[0.5, 2.0, 3.0], [-1.0, 0.125, 10.0], [7.0, 0.25, 1.5]], np.float32)
    got = npr.dequant_fp8_block(fp8, scale, (2, 3))
    assert got.dtype == np.float64 and got.shape == (5, 7)
    want = np.empty((5, 7))
    for r in range(5):
        for c in range(7):
            want[r, c] = vals[r, c] * scale[r // 2, c // 3]
    np.testing.assert_array_equal(got, want)
    # a few by hand
    assert got[0, 6] == 448.0 * 3.0  # first row block, partial last column block
    assert got[4, 6] == 0.875 * 1.5  # partial row block x partial column block
    assert got[3, 2] == 7.0 * -1.0
    assert got[2, 4] == 10.0 * 0.125


def test_dequant_mxfp4_nibbles_sign_scale():
    # one row of 64 elements = 32 bytes, 2 scale groups
    codes = np.zeros(64, np.uint8)
    codes[0], codes[1] = 0xB, 0x2  # -1.5 (low nibble -> element 0), +1.0 (high -> element 1)
    codes[2], codes[3] = 0x7, 0xF  # +6, -6
    codes[4], codes[5] = 0x8, 0x1  # -0, +0.5
    rng = np.random.default_rng(0)
    codes[6:] = rng.integers(0, 16, 58)
    packed = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)[None, :]  # [1, 32]
    assert packed[0, 0] == 0x2B and packed[0, 1] == 0xF7 and packed[0, 2] == 0x18
    table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    want = table[codes] * np.repeat([0.25, 8.0], 32)
    for scales in (
        np.array([[0.25, 8.0]], np.float32),  # real powers of two
        np.array([[0.25, 8.0]]).astype(ml_dtypes.float8_e8m0fnu),  # E8M0 dtype
        np.array([[125, 130]], np.uint8),  # raw exponents 2^(u-127)
    ):
        got = npr.dequant_mxfp4(packed, scales)
        assert got.dtype == np.float64 and got.shape == (1, 64)
        np.testing.assert_array_equal(got, want[None])
    got = npr.dequant_mxfp4(packed.view(np.int8), np.array([[127, 127]], np.uint8))
    assert got[0, 0] == -1.5 and got[0, 1] == 1.0 and got[0, 2] == 6.0 and got[0, 3] == -6.0
    assert got[0, 4] == 0.0 and np.signbit(got[0, 4]) and got[0, 5] == 0.5
    # compare with ml_dtypes' own E2M1 decoding
    e2m1 = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64) if hasattr(ml_dtypes, "float4_e2m1fn") else None
    if e2m1 is not None:
        np.testing.assert_array_equal(got[0], e2m1)
