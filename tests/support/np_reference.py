"""Independent float64 NumPy reference of the Ling 3.x hybrid model (KDA + gated MLA + MoE).

Written from ``shared/ling_v3_spec.md`` (sections in brackets below).  Pure NumPy, float64
everywhere, no JAX / torch.  It is deliberately slow and literal: the KDA layer uses the plain
per-token recurrence, attention is the expanded (non-absorbed) MLA form, and every routed expert
is evaluated with an explicit loop.

Public API
----------
forward(weights, config, input_ids)            -> {"logits": [B,T,V], "hidden": [B,T,D]}
mtp_draft_logits(weights, config, hidden, ids) -> [B,T,V]
kda_attention(weights, config, prefix, x_BTD)  -> [B,T,D]: one KDA layer from a zero state (spec §2)
kda_recurrence(q, k, v, g, beta, state)        -> (o, final state): the delta rule on normalised q, k
dequant_fp8_block(w_fp8, scale_inv, block)     -> float64 weight
dequant_mxfp4(packed, scales)                  -> float64 weight
rope_inv_freq_and_mscale(config)               -> (inv_freq [dr/2], cos/sin factor, softmax scale)
route(x_TD, gate_weight_ED, expert_bias_E, config) -> (topk_idx [T,k] ascending, weights [T,k])

``weights`` maps ORIGINAL checkpoint tensor names (spec §6.1) to (already dequantised) arrays.
``config`` is a plain dict in either the inclusionAI or the transformers ``save_pretrained``
spelling (spec §1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = [
    "forward",
    "mtp_draft_logits",
    "kda_attention",
    "kda_recurrence",
    "dequant_fp8_block",
    "dequant_mxfp4",
    "rope_inv_freq_and_mscale",
    "route",
]

F64 = np.float64

# ----------------------------------------------------------------------------------------------
# Config handling (spec §1): accept both the inclusionAI and the transformers spellings.
# ----------------------------------------------------------------------------------------------


def _get(config: Mapping, *names: str, default: Any = None) -> Any:
    """First present, non-None value among ``names``."""
    for n in names:
        if n in config and config[n] is not None:
            return config[n]
    return default


def _require(config: Mapping, *names: str) -> Any:
    v = _get(config, *names)
    if v is None:
        raise KeyError(f"config lacks all of {names}")
    return v


def _num_layers(config: Mapping) -> int:
    return int(_require(config, "num_hidden_layers"))


def _is_first_kind(types, first: str, second: str, what: str) -> list[bool]:
    """True where a layer's type is `first`, False where `second`; any other type is an error naming `what`."""
    unknown = [t for t in types if t not in (first, second)]
    if unknown:
        raise ValueError(f"unknown {what} {unknown[0]!r}")
    return [t == first for t in types]


def _layer_is_kda(config: Mapping) -> list[bool]:
    """True for KDA (linear attention) layers, False for MLA layers."""
    n = _num_layers(config)
    lt = config.get("layer_types")
    if lt is not None:  # explicit list wins
        assert len(lt) >= n, "layer_types shorter than num_hidden_layers"
        return _is_first_kind(lt[:n], "linear_attention", "full_attention", "layer type")
    g = _require(config, "layer_group_size")
    if isinstance(g, (list, tuple)):
        assert len(g) >= n, "layer_group_size list shorter than num_hidden_layers"
        return [int(v) == 1 for v in g[:n]]
    g = int(g)
    if g <= 0:
        return [False] * n
    return [(i + 1) % g != 0 for i in range(n)]


def _layer_is_dense_mlp(config: Mapping) -> list[bool]:
    n = _num_layers(config)
    mt = config.get("mlp_layer_types")
    if mt is not None:
        return _is_first_kind(mt[:n], "dense", "sparse", "mlp layer type")
    if int(_get(config, "num_experts", "num_local_experts", default=0)) == 1:
        return [True] * n
    k = int(_get(config, "first_k_dense_replace", default=0))
    return [i < k for i in range(n)]


def _kda_head_dim(config: Mapping) -> int:
    # save_pretrained overwrites head_dim with qk_rope_head_dim and stores the KDA dim here.
    return int(_require(config, "linear_head_dim", "head_dim"))


def _kda_num_heads(config: Mapping) -> int:
    return int(_require(config, "linear_num_heads", "num_attention_heads"))


def _eps(config: Mapping) -> float:
    return float(_get(config, "rms_norm_eps", default=1e-6))


def _rope_dict(config: Mapping) -> dict:
    rs = config.get("rope_scaling")
    if isinstance(rs, Mapping):
        return dict(rs)
    rp = config.get("rope_parameters")
    if isinstance(rp, Mapping):
        return dict(rp)
    return {}


def _rope_theta(config: Mapping) -> float:
    # transformers v5 keeps the authoritative theta inside rope_parameters (its save_pretrained output
    # may also carry a stale top-level default); inclusionAI configs have it at the top level.
    for key in ("rope_parameters", "rope_scaling"):
        d = config.get(key)
        if isinstance(d, Mapping) and d.get("rope_theta") is not None:
            return float(d["rope_theta"])
    th = config.get("rope_theta")
    if th is None:
        raise KeyError("rope_theta missing (top level and rope_parameters)")
    return float(th)


def _swiglu_limit(config: Mapping, key: str, index: int) -> float | None:
    lst = config.get(key)
    if lst is None:
        return None
    if index < 0 or index >= len(lst):
        return None
    v = lst[index]
    if v is None or float(v) == 0.0:
        return None
    return float(v)


# ----------------------------------------------------------------------------------------------
# Elementary ops
# ----------------------------------------------------------------------------------------------


def _w(weights: Mapping, name: str) -> np.ndarray:
    if name not in weights:
        raise KeyError(f"missing weight {name}")
    return np.asarray(weights[name]).astype(F64)


def _has(weights: Mapping, name: str) -> bool:
    return name in weights


def _linear(x: np.ndarray, w_OI: np.ndarray) -> np.ndarray:
    """y = x W^T with W stored [out, in] (torch layout)."""
    return x @ w_OI.T


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # numerically stable for large |x|
    out = np.empty_like(x, dtype=F64)
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    ex = np.exp(x[~pos])
    out[~pos] = ex / (1.0 + ex)
    return out


def _silu(x: np.ndarray) -> np.ndarray:
    return x * _sigmoid(x)


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def _swiglu(a: np.ndarray, u: np.ndarray, limit: float | None) -> np.ndarray:
    """act(a, u) = min(SiLU(a), lam) * clip(u, -lam, lam) (spec §4); plain SiLU(a)*u without limit."""
    s = _silu(a)
    if limit is None:
        return s * u
    return np.minimum(s, limit) * np.clip(u, -limit, limit)


def _mlp(weights: Mapping, prefix: str, x: np.ndarray, limit: float | None) -> np.ndarray:
    a = _linear(x, _w(weights, prefix + ".gate_proj.weight"))
    u = _linear(x, _w(weights, prefix + ".up_proj.weight"))
    return _linear(_swiglu(a, u, limit), _w(weights, prefix + ".down_proj.weight"))


# ----------------------------------------------------------------------------------------------
# KDA (spec §2) — plain recurrence
# ----------------------------------------------------------------------------------------------


def _causal_depthwise_conv_silu(u_BTC: np.ndarray, w_C1K: np.ndarray) -> np.ndarray:
    """y_t[c] = SiLU(sum_j w[c, j] * u_{t-K+1+j}[c]), u_{<0} = 0, no bias."""
    w = w_C1K.reshape(w_C1K.shape[0], w_C1K.shape[-1])  # [C, K]
    K = w.shape[1]
    B, T, C = u_BTC.shape
    assert w.shape[0] == C, (w.shape, C)
    padded = np.concatenate([np.zeros((B, K - 1, C), F64), u_BTC], axis=1)
    y = np.zeros((B, T, C), F64)
    for j in range(K):
        # tap j multiplies u_{t-K+1+j}; tap K-1 is the current token
        y += padded[:, j : j + T, :] * w[:, j]
    return _silu(y)


def _l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def kda_recurrence(q, k, v, g, beta, initial_state=None):
    """The delta rule of spec §2 step 7 on already-normalised q, k: q, k [B,T,H,d], v [B,T,H,dv], g [B,T,H,d],
    beta [B,T,H]; returns (o [B,T,H,dv], final state [B,H,d,dv]), float64."""
    q, k, v, g, beta = (np.asarray(x, F64) for x in (q, k, v, g, beta))
    B, T, H, d = q.shape
    dv = v.shape[-1]
    S = np.zeros((B, H, d, dv), F64) if initial_state is None else np.array(initial_state, F64)
    o = np.zeros((B, T, H, dv), F64)
    qs = q / math.sqrt(d)
    for t in range(T):
        S = S * np.exp(g[:, t])[..., None]  # decay row i by exp(g_t[i])
        pred = np.einsum("bhkv,bhk->bhv", S, k[:, t])  # S^T k
        delta = beta[:, t][..., None] * (v[:, t] - pred)
        S = S + k[:, t][..., :, None] * delta[..., None, :]
        o[:, t] = np.einsum("bhkv,bhk->bhv", S, qs[:, t])
    return o, S


def kda_attention(weights: Mapping, config: Mapping, prefix: str, x_BTD: np.ndarray) -> np.ndarray:
    H = _kda_num_heads(config)
    d = _kda_head_dim(config)
    B, T, _ = x_BTD.shape
    p = prefix + "."

    q = _linear(x_BTD, _w(weights, p + "q_proj.weight"))
    k = _linear(x_BTD, _w(weights, p + "k_proj.weight"))
    v = _linear(x_BTD, _w(weights, p + "v_proj.weight"))
    C = H * d
    assert q.shape[-1] == C and k.shape[-1] == C, (q.shape, k.shape, H, d)

    if _has(weights, p + "q_conv1d.weight"):
        wq = _w(weights, p + "q_conv1d.weight")
        wk = _w(weights, p + "k_conv1d.weight")
        wv = _w(weights, p + "v_conv1d.weight")
    else:  # HF-style concatenated depthwise conv [q; k; v]
        wc = _w(weights, p + "conv1d.weight")
        wq, wk, wv = wc[:C], wc[C : 2 * C], wc[2 * C :]
    q = _causal_depthwise_conv_silu(q, wq)
    k = _causal_depthwise_conv_silu(k, wk)
    v = _causal_depthwise_conv_silu(v, wv)

    dv = v.shape[-1] // H
    q = _l2norm(q.reshape(B, T, H, d))
    k = _l2norm(k.reshape(B, T, H, d))
    v = v.reshape(B, T, H, dv)

    # forget-gate input f and output-gate input r (full rank or low rank)
    if _has(weights, p + "f_proj.weight"):
        f = _linear(x_BTD, _w(weights, p + "f_proj.weight"))
    else:
        f = _linear(_linear(x_BTD, _w(weights, p + "f_a_proj.weight")), _w(weights, p + "f_b_proj.weight"))
    if _has(weights, p + "g_proj.weight"):
        r = _linear(x_BTD, _w(weights, p + "g_proj.weight"))
    else:
        r = _linear(_linear(x_BTD, _w(weights, p + "g_a_proj.weight")), _w(weights, p + "g_b_proj.weight"))

    a = (f + _w(weights, p + "dt_bias").reshape(C)).reshape(B, T, H, d)
    A = np.exp(_w(weights, p + "A_log").reshape(H))[None, None, :, None]
    safe = bool(_get(config, "kda_safe_gate", default=True))
    if safe:
        lower = float(_get(config, "kda_lower_bound", default=-5.0))
        g = lower * _sigmoid(A * a)
    else:
        g = -A * _softplus(a)

    beta = _sigmoid(_linear(x_BTD, _w(weights, p + "b_proj.weight")))  # [B, T, H]

    o, _ = kda_recurrence(q, k, v, g, beta)

    # gated RMSNorm per head
    w_on = _w(weights, p + "o_norm.weight")
    o = _rms_norm(o, w_on, _eps(config)) * _sigmoid(r.reshape(B, T, H, dv))
    o = o.reshape(B, T, H * dv)
    wo = _w(weights, p + "dense.weight") if _has(weights, p + "dense.weight") else _w(weights, p + "o_proj.weight")
    return _linear(o, wo)


# ----------------------------------------------------------------------------------------------
# RoPE / YaRN (spec §3.2, §3.3, §3.5) and MLA (spec §3.1)
# ----------------------------------------------------------------------------------------------


def _yarn_m(s: float, mu: float) -> float:
    return 1.0 if s <= 1 else 0.1 * mu * math.log(s) + 1.0


def rope_inv_freq_and_mscale(config: Mapping) -> tuple[np.ndarray, float, float]:
    """(inv_freq [dr/2] float64, cos/sin multiplier, softmax scale)."""
    dr = int(_require(config, "qk_rope_head_dim"))
    dn = int(_require(config, "qk_nope_head_dim"))
    theta = _rope_theta(config)
    rd = _rope_dict(config)
    i = np.arange(dr // 2, dtype=F64)
    inv_freq = theta ** (-2.0 * i / dr)
    base_scale = (dn + dr) ** -0.5

    rope_type = rd.get("rope_type", rd.get("type", "default"))
    factor = rd.get("factor")
    if rope_type not in ("yarn", "deepseek_yarn") or factor is None or float(factor) <= 1.0:
        return inv_freq, 1.0, base_scale

    f = float(factor)
    L0 = float(_require(rd, "original_max_position_embeddings"))
    beta_fast = float(_get(rd, "beta_fast", default=32.0))
    beta_slow = float(_get(rd, "beta_slow", default=1.0))
    mscale = float(_get(rd, "mscale", default=1.0))
    mscale_all_dim = float(_get(rd, "mscale_all_dim", default=0.0))
    attn_factor = float(_get(rd, "attn_factor", default=1.0))
    extrapolation_factor = float(_get(rd, "extrapolation_factor", default=1.0))
    truncate = bool(_get(rd, "truncate", default=True))

    def corr(r: float) -> float:
        return dr * math.log(L0 / (2 * math.pi * r)) / (2 * math.log(theta))

    lo, hi = corr(beta_fast), corr(beta_slow)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dr - 1)
    if lo == hi:
        hi += 0.001
    ramp = np.clip((i - lo) / (hi - lo), 0.0, 1.0)
    keep = (1.0 - ramp) * extrapolation_factor
    inv_freq = inv_freq * (keep + (1.0 - keep) / f)

    cos_sin_factor = _yarn_m(f, mscale) / _yarn_m(f, mscale_all_dim) * attn_factor
    softmax_scale = base_scale * _yarn_m(f, mscale_all_dim) ** 2
    return inv_freq, cos_sin_factor, softmax_scale


def _apply_rope(x: np.ndarray, pos_T: np.ndarray, inv_freq: np.ndarray, factor: float, interleave: bool) -> np.ndarray:
    """x [..., T, n, dr] (n = heads or 1); rotates pairs by angle pos * inv_freq."""
    ang = pos_T[:, None].astype(F64) * inv_freq[None, :]  # [T, dr/2]
    cos = (np.cos(ang) * factor)[:, None, :]
    sin = (np.sin(ang) * factor)[:, None, :]
    out = np.empty_like(x)
    if interleave:
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x1 * cos + x0 * sin
    else:
        h = x.shape[-1] // 2
        x0, x1 = x[..., :h], x[..., h:]
        out[..., :h] = x0 * cos - x1 * sin
        out[..., h:] = x1 * cos + x0 * sin
    return out


def _mla_attention(weights: Mapping, config: Mapping, prefix: str, x_BTD: np.ndarray) -> np.ndarray:
    H = int(_require(config, "num_attention_heads"))
    dn = int(_require(config, "qk_nope_head_dim"))
    dr = int(_require(config, "qk_rope_head_dim"))
    dv = int(_require(config, "v_head_dim"))
    Rkv = int(_require(config, "kv_lora_rank"))
    eps = _eps(config)
    B, T, _ = x_BTD.shape
    p = prefix + "."

    # query
    if config.get("q_lora_rank"):  # int -> q-LoRA; null/absent -> single q_proj
        cq = _rms_norm(_linear(x_BTD, _w(weights, p + "q_a_proj.weight")), _w(weights, p + "q_a_layernorm.weight"), eps)
        q = _linear(cq, _w(weights, p + "q_b_proj.weight"))
    else:
        q = _linear(x_BTD, _w(weights, p + "q_proj.weight"))
    q = q.reshape(B, T, H, dn + dr)
    q_nope, q_pe = q[..., :dn], q[..., dn:]

    # keys / values
    kva = _linear(x_BTD, _w(weights, p + "kv_a_proj_with_mqa.weight"))
    assert kva.shape[-1] == Rkv + dr
    c_kv = _rms_norm(kva[..., :Rkv], _w(weights, p + "kv_a_layernorm.weight"), eps)
    k_pe = kva[..., Rkv:][:, :, None, :]  # [B, T, 1, dr], shared by all heads
    kvb = _linear(c_kv, _w(weights, p + "kv_b_proj.weight")).reshape(B, T, H, dn + dv)
    k_nope, v = kvb[..., :dn], kvb[..., dn:]

    # RoPE on the rope dims only
    inv_freq, cs_factor, scale = rope_inv_freq_and_mscale(config)
    interleave = bool(_get(config, "rope_interleave", default=True))
    pos = np.arange(T)
    q_pe = _apply_rope(q_pe, pos, inv_freq, cs_factor, interleave)
    k_pe = _apply_rope(k_pe, pos, inv_freq, cs_factor, interleave)

    s = np.einsum("bthd,bshd->bhts", q_nope, k_nope) + np.einsum("bthd,bsd->bhts", q_pe, k_pe[:, :, 0])
    s = s * scale
    causal = np.tril(np.ones((T, T), bool))
    s = np.where(causal[None, None], s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    pr = np.exp(s)
    pr = pr / pr.sum(axis=-1, keepdims=True)
    o = np.einsum("bhts,bshd->bthd", pr, v)  # [B, T, H, dv]

    # output gate (head-wise [H, D] in Ling; element-wise [H*dv, D] tolerated; absent -> none)
    if _has(weights, p + "g_proj.weight"):
        wg = _w(weights, p + "g_proj.weight")
        gate = _sigmoid(_linear(x_BTD, wg))
        if wg.shape[0] == H:
            o = o * gate[..., None]
        elif wg.shape[0] == H * dv:
            o = o * gate.reshape(B, T, H, dv)
        else:
            raise ValueError(f"unexpected MLA g_proj shape {wg.shape}")

    wo = _w(weights, p + "dense.weight") if _has(weights, p + "dense.weight") else _w(weights, p + "o_proj.weight")
    return _linear(o.reshape(B, T, H * dv), wo)


# ----------------------------------------------------------------------------------------------
# Router and MoE (spec §4)
# ----------------------------------------------------------------------------------------------


def route(x_TD: np.ndarray, gate_weight_ED: np.ndarray, expert_bias_E: np.ndarray, config: Mapping):
    """Returns (topk_idx [T, k] sorted ascending, routing weights [T, k] matching)."""
    x = np.asarray(x_TD, F64)
    W = np.asarray(gate_weight_ED, F64)
    b = np.zeros(W.shape[0], F64) if expert_bias_E is None else np.asarray(expert_bias_E, F64).reshape(-1)
    E = W.shape[0]
    k = int(_require(config, "num_experts_per_tok", "num_experts_per_token"))
    G = int(_get(config, "n_group", "num_expert_group", default=0) or 0)
    Tg = int(_get(config, "topk_group", default=0) or 0)
    renorm = bool(_get(config, "norm_topk_prob", "moe_renormalize", default=True))
    rsf = float(_get(config, "routed_scaling_factor", default=2.5))

    s = _sigmoid(x @ W.T)  # [T, E]
    sel = s + b[None, :]  # biased scores: selection only
    T = s.shape[0]
    if G > 0 and Tg > 0 and Tg < G:
        assert E % G == 0
        grp = sel.reshape(T, G, E // G)
        top2 = -np.sort(-grp, axis=-1)[..., :2]
        gscore = top2.sum(-1)  # [T, G]
        keep_groups = np.argsort(-gscore, axis=-1, kind="stable")[:, :Tg]
        gmask = np.zeros((T, G), bool)
        np.put_along_axis(gmask, keep_groups, True, axis=-1)
        emask = np.repeat(gmask, E // G, axis=-1)
        sel = np.where(emask, sel, -np.inf)
    idx = np.argsort(-sel, axis=-1, kind="stable")[:, :k]
    idx = np.sort(idx, axis=-1)
    w = np.take_along_axis(s, idx, axis=-1)  # un-biased sigmoid
    if renorm:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    w = w * rsf
    return idx, w


def _moe(weights: Mapping, config: Mapping, prefix: str, x_BTD: np.ndarray, limit_index: int) -> np.ndarray:
    B, T, D = x_BTD.shape
    x = x_BTD.reshape(B * T, D)
    p = prefix + "."
    bias = _w(weights, p + "gate.expert_bias") if _has(weights, p + "gate.expert_bias") else None
    idx, wts = route(x, _w(weights, p + "gate.weight"), bias, config)

    lam_r = _swiglu_limit(config, "expert_swiglu_limit_list", limit_index)
    lam_s = _swiglu_limit(config, "share_expert_swiglu_limit_list", limit_index)

    out = np.zeros_like(x)
    for e in np.unique(idx):
        rows, slot = np.nonzero(idx == e)
        y = _mlp(weights, f"{p}experts.{int(e)}", x[rows], lam_r)
        np.add.at(out, rows, y * wts[rows, slot][:, None])

    if _has(weights, p + "shared_experts.gate_proj.weight"):
        expect = _get(config, "moe_shared_expert_intermediate_size")
        if expect is None and _get(config, "moe_intermediate_size") is not None:
            expect = int(config["moe_intermediate_size"]) * int(
                _get(config, "num_shared_experts", "n_shared_experts", default=1)
            )
        got = np.shape(weights[p + "shared_experts.gate_proj.weight"])[0]
        assert expect is None or got == int(expect), f"shared expert width {got} != config {expect}"
        out = out + _mlp(weights, p + "shared_experts", x, lam_s)  # not scaled
    return out.reshape(B, T, D)


# ----------------------------------------------------------------------------------------------
# Decoder layers, model, MTP (spec §5)
# ----------------------------------------------------------------------------------------------


def _decoder_layer(
    weights: Mapping,
    config: Mapping,
    layer: int,
    h: np.ndarray,
    *,
    is_kda: bool,
    is_dense: bool,
    limit_index: int,
) -> np.ndarray:
    p = f"model.layers.{layer}"
    eps = _eps(config)
    x = _rms_norm(h, _w(weights, p + ".input_layernorm.weight"), eps)
    if is_kda:
        h = h + kda_attention(weights, config, p + ".attention", x)
    else:
        h = h + _mla_attention(weights, config, p + ".attention", x)
    x = _rms_norm(h, _w(weights, p + ".post_attention_layernorm.weight"), eps)
    if is_dense:
        h = h + _mlp(weights, p + ".mlp", x, None)  # dense MLPs are never clipped
    else:
        h = h + _moe(weights, config, p + ".mlp", x, limit_index)
    return h


def _embed(weights: Mapping, ids: np.ndarray) -> np.ndarray:
    emb = _w(weights, "model.word_embeddings.weight")
    return emb[np.asarray(ids, dtype=np.int64)]


def _lm_head(weights: Mapping, config: Mapping, h: np.ndarray) -> np.ndarray:
    if _has(weights, "lm_head.weight"):
        W = _w(weights, "lm_head.weight")
    elif bool(_get(config, "tie_word_embeddings", default=False)):
        W = _w(weights, "model.word_embeddings.weight")
    else:
        raise KeyError("lm_head.weight missing and tie_word_embeddings is false")
    return _linear(h, W)


def forward(weights: Mapping[str, np.ndarray], config: Mapping, input_ids: np.ndarray) -> dict:
    ids = np.asarray(input_ids)
    assert ids.ndim == 2, "input_ids must be [B, T]"
    kda = _layer_is_kda(config)
    dense = _layer_is_dense_mlp(config)
    h = _embed(weights, ids)
    for i in range(_num_layers(config)):
        h = _decoder_layer(weights, config, i, h, is_kda=kda[i], is_dense=dense[i], limit_index=i)
    h = _rms_norm(h, _w(weights, "model.norm.weight"), _eps(config))
    return {"logits": _lm_head(weights, config, h), "hidden": h}


def mtp_draft_logits(weights, config, hidden_BTD: np.ndarray, next_ids_BT: np.ndarray) -> np.ndarray:
    """Draft logits of the MTP (nextn) layer stored at index L = num_hidden_layers (spec §5).

    hidden_BTD: main model final hidden (post model.norm), next_ids_BT: token t+1 at position t.
    """
    L = _num_layers(config)
    p = f"model.layers.{L}"
    eps = _eps(config)
    e = _embed(weights, next_ids_BT)
    hdn = np.asarray(hidden_BTD, F64)
    cat = np.concatenate(
        [_rms_norm(e, _w(weights, p + ".enorm.weight"), eps), _rms_norm(hdn, _w(weights, p + ".hnorm.weight"), eps)],
        axis=-1,
    )
    z = _linear(cat, _w(weights, p + ".eh_proj.weight"))
    is_dense = not _has(weights, p + ".mlp.gate.weight")  # Ling's MTP layer is always MoE
    # SGLang builds the MTP MoE with layer id 0 -> clip limits looked up at index 0.
    z = _decoder_layer(weights, config, L, z, is_kda=False, is_dense=is_dense, limit_index=0)
    z = _rms_norm(z, _w(weights, p + ".final_layernorm.weight"), eps)
    return _lm_head(weights, config, z)


# ----------------------------------------------------------------------------------------------
# Dequantisation (spec §6.2, §6.3)
# ----------------------------------------------------------------------------------------------


def dequant_fp8_block(w_fp8: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """W[r, c] = fp8[r, c] * scale_inv[r // br, c // bc] (the 'inv' scale multiplies)."""
    w = np.asarray(w_fp8).astype(F64)
    s = np.asarray(scale_inv).astype(F64)
    br, bc = int(block[0]), int(block[1])
    R, C = w.shape[-2:]
    assert s.shape[-2:] == (-(-R // br), -(-C // bc)), (s.shape, w.shape, block)
    full = np.repeat(np.repeat(s, br, axis=-2), bc, axis=-1)[..., :R, :C]
    return w * full


_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], F64)


def _e8m0_to_f64(scales: np.ndarray) -> np.ndarray:
    s = np.asarray(scales)
    if s.dtype.kind in "iu":  # raw exponents
        u = s.astype(np.int64) & 0xFF
        out = np.exp2(u.astype(F64) - 127.0)
        return np.where(u == 255, np.nan, out)
    return s.astype(F64)  # float8_e8m0fnu or real float values


def dequant_mxfp4(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """packed [..., N/2] (int8/uint8), scales [..., N/32] -> float64 [..., N].

    Byte j holds element 2j in the low nibble and 2j+1 in the high nibble (E2M1 codes)."""
    b = np.asarray(packed)
    if b.dtype == np.int8:
        b = b.view(np.uint8)
    elif b.dtype != np.uint8:
        assert b.dtype.kind in "iu", b.dtype
        b = b.astype(np.uint8)
    lo = _E2M1[b & 0x0F]
    hi = _E2M1[b >> 4]
    vals = np.stack([lo, hi], axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])
    s = _e8m0_to_f64(scales)
    N = vals.shape[-1]
    assert s.shape[:-1] == vals.shape[:-1] and s.shape[-1] == -(-N // 32), (s.shape, vals.shape)
    return vals * np.repeat(s, 32, axis=-1)[..., :N]
