import json
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from checkpoint_factory import (
    dequantize_fp8_block,
    make_quantized_checkpoint,
    quantize_fp8_block,
    quantize_mxfp4,
    read_checkpoint_raw,
    read_checkpoint_tensors,
    read_safetensors,
    write_safetensors,
)
from oracle import build_oracle, save_oracle
from safetensors import safe_open

from ling_jax.quant import E2M1_VALUES, dequantize_mxfp4, unpack_e2m1


def test_write_safetensors_roundtrip(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "a.f32": rng.standard_normal((3, 5)).astype(np.float32),
        "b.bf16": rng.standard_normal((7,)).astype(ml_dtypes.bfloat16),
        "c.fp8": (rng.standard_normal((4, 6)) * 10).astype(ml_dtypes.float8_e4m3fn),
        "d.u8": rng.integers(0, 256, size=(2, 9)).astype(np.uint8),
        "e.i8": rng.integers(-128, 128, size=(5,)).astype(np.int8),
        "f.e8m0": np.array([1.0, 2.0, 0.25, 2.0**-20], np.float32).astype(ml_dtypes.float8_e8m0fnu),
    }
    path = tmp_path / "x.safetensors"
    write_safetensors(path, tensors)
    raw = path.read_bytes()
    (hlen,) = np.frombuffer(raw[:8], "<u8")
    assert hlen % 8 == 0
    expect_dtype = {
        "a.f32": torch.float32,
        "b.bf16": torch.bfloat16,
        "c.fp8": torch.float8_e4m3fn,
        "d.u8": torch.uint8,
        "e.i8": torch.int8,
        "f.e8m0": getattr(torch, "float8_e8m0fnu", None),
    }
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        for k in ("a.f32", "b.bf16", "c.fp8", "d.u8", "e.i8"):
            t = f.get_tensor(k)
            assert t.dtype == expect_dtype[k], k
            assert tuple(t.shape) == tensors[k].shape
            if t.dtype.is_floating_point:
                np.testing.assert_array_equal(t.float().numpy(), tensors[k].astype(np.float32))
            else:
                np.testing.assert_array_equal(t.numpy(), tensors[k])
        if expect_dtype["f.e8m0"] is not None:
            t = f.get_tensor("f.e8m0")
            assert t.dtype == expect_dtype["f.e8m0"]
            np.testing.assert_array_equal(t.float().numpy(), [1.0, 2.0, 0.25, 2.0**-20])
    back = read_safetensors(path)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        np.testing.assert_array_equal(back[k].view(np.uint8), v.view(np.uint8))


def test_quantize_fp8_block_partial_edges():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((300, 200)).astype(np.float32)
    w[:, 150:] *= 20.0  # blocks with different magnitudes
    w[256:, 128:] = 0.0  # an all-zero (partial) block
    q, s = quantize_fp8_block(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and q.shape == (300, 200)
    assert s.dtype == np.float32 and s.shape == (3, 2)
    assert s[2, 1] == 1.0 and np.all(q[256:, 128:].astype(np.float32) == 0)
    # scale multiplies, and the block amax maps to 448
    np.testing.assert_allclose(s[0, 0], np.abs(w[:128, :128]).max() / 448.0, rtol=1e-6)
    np.testing.assert_allclose(s[2, 0], np.abs(w[256:, :128]).max() / 448.0, rtol=1e-6)
    assert np.abs(q.astype(np.float32)).max() == 448.0
    deq = dequantize_fp8_block(q, s)
    manual = q.astype(np.float32) * np.repeat(np.repeat(s, 128, 0), 128, 1)[:300, :200]
    np.testing.assert_array_equal(deq, manual)
    rel = np.linalg.norm(deq - w) / np.linalg.norm(w)
    assert rel <= 0.07, rel
    normal = np.abs(w) >= np.repeat(np.repeat(s, 128, 0), 128, 1)[:300, :200] * 2.0**-6  # e4m3 normal range
    assert normal.mean() > 0.9
    assert np.all(np.abs(deq - w)[normal] <= 2.0**-4 * np.abs(w)[normal] * (1 + 1e-6))


def test_mxfp4_pack_known_row():
    # group 0: amax 6 -> scale 1 (u = 127); group 1: amax 0.75 -> scale 2^-3 (0.75 / 0.125 = 6; u = 124)
    g0 = [0.5, -1.0, 6.0, 1.5, 0.0, -6.0, 3.0, 2.0, -0.5, 4.0, 1.0, -3.0, 0.26, 0.24, 5.1, 4.9] + [0.0] * 16
    g1 = [0.75, -0.125, 0.25, 0.0625] + [0.0] * 28
    w = np.array([g0 + g1], np.float32)
    packed, s = quantize_mxfp4(w, "float32")
    assert packed.dtype == np.uint8 and packed.shape == (1, 32)
    assert s.dtype == np.float32 and s.shape == (1, 2)
    np.testing.assert_array_equal(s, [[1.0, 0.125]])
    # element 2j -> LOW nibble, element 2j+1 -> HIGH nibble
    assert packed[0, 0] == 0xA1  # 0.5 -> code 1 (low), -1 -> code 8|2 = 0xA (high)
    assert packed[0, 1] == 0x37  # 6 -> 7 (low), 1.5 -> 3 (high)
    assert packed[0, 2] == 0xF0  # 0 -> 0 (low), -6 -> 0xF (high)
    assert packed[0, 3] == 0x45  # 3 -> 5 (low), 2 -> 4 (high)
    assert packed[0, 4] == 0x69  # -0.5 -> 9 (low), 4 -> 6 (high)
    assert packed[0, 5] == 0xD2  # 1 -> 2 (low), -3 -> 0xD (high)
    assert packed[0, 6] == 0x01  # 0.26 -> 0.5 = code 1 (low), 0.24 -> 0 (high)
    assert packed[0, 7] == 0x67  # 5.1 -> 6 = 7 (low), 4.9 -> 4 = 6 (high)
    # group 1 (scale 1/8): 0.75 -> 6 (code 7), -0.125 -> -1 (code 0xA), 0.25 -> 2 (code 4), 0.0625 -> 0.5 (code 1)
    assert packed[0, 16] == 0xA7 and packed[0, 17] == 0x14
    codes = unpack_e2m1(packed)
    assert codes[0, 0] == 1 and codes[0, 1] == 0xA
    deq = dequantize_mxfp4(packed, s)
    np.testing.assert_array_equal(deq[0, :12], g0[:12])
    np.testing.assert_array_equal(deq[0, 32:36], [0.75, -0.125, 0.25, 0.0625])
    # the other scale storage formats
    _, su = quantize_mxfp4(w, "uint8")
    assert su.dtype == np.uint8 and su.tolist() == [[127, 124]]
    _, se = quantize_mxfp4(w, "e8m0")
    assert se.dtype == ml_dtypes.float8_e8m0fnu
    np.testing.assert_array_equal(se.astype(np.float32), s)
    np.testing.assert_array_equal(dequantize_mxfp4(packed, su), deq)
    np.testing.assert_array_equal(dequantize_mxfp4(packed, se), deq)


def test_mxfp4_random_matches_ml_dtypes_rounding():
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((16, 96)) * np.exp(rng.uniform(-4, 4, (16, 1)))).astype(np.float32)
    packed, s = quantize_mxfp4(w)
    assert packed.shape == (16, 48) and s.shape == (16, 3)
    assert np.all(np.log2(s) == np.round(np.log2(s)))
    deq = dequantize_mxfp4(packed, s)
    s_full = np.repeat(s, 32, 1)
    assert np.all(np.abs(w / s_full) <= 6.0)
    ref = (w / s_full).astype(ml_dtypes.float4_e2m1fn).astype(np.float32) * s_full
    np.testing.assert_array_equal(deq, ref)
    assert set(np.unique(deq / s_full)) <= set(E2M1_VALUES.tolist())


@pytest.mark.parametrize("mxfp4", [False, True])
def test_make_quantized_checkpoint_g4_wide(tmp_path, mxfp4):
    model = build_oracle("g4_wide", seed=0)
    src = save_oracle(model, tmp_path / "src")
    cfg_src, orig = read_checkpoint_tensors(src)
    assert "model.word_embeddings.weight" in orig and "model.layers.3.attention.dense.weight" in orig
    assert "model.layers.1.mlp.experts.15.gate_proj.weight" in orig and "model.layers.1.mlp.gate.expert_bias" in orig
    dst = tmp_path / "dst"
    deq = make_quantized_checkpoint(src, dst, mxfp4_experts=mxfp4, num_shards=3, mxfp4_scale_format="e8m0")

    # returned dict: original names and shapes, float32, close to the originals
    assert set(deq) == set(orig)
    for k, v in deq.items():
        assert v.shape == orig[k].shape and v.dtype == np.float32, k
        err = np.linalg.norm(v - orig[k]) / max(np.linalg.norm(orig[k]), 1e-30)
        assert err < (0.2 if (mxfp4 and ".mlp.experts." in k) else 0.07), (k, err)

    # index / shards
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    in_files = {}
    for fn in files:
        assert (dst / fn).exists()
        with safe_open(str(dst / fn), framework="pt") as f:
            for k in f.keys():
                in_files[k] = fn
    assert in_files == index["weight_map"]
    assert set(index["weight_map"]) >= set(orig)
    cfg, raw = read_checkpoint_raw(dst)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in raw.values())

    qc = cfg["quantization_config"]
    assert (
        qc["quant_method"] == "fp8" and qc["activation_scheme"] == "dynamic" and qc["weight_block_size"] == [128, 128]
    )
    assert ("routed_experts_quant_method" in qc) == mxfp4
    assert (
        "lm_head" in qc["modules_to_not_convert"] and "model.layers.3.attention.g_proj" in qc["modules_to_not_convert"]
    )
    assert cfg["linear_head_dim"] == cfg_src["linear_head_dim"] == 16

    D, Im, I = 160, 144, 200
    f8 = np.dtype(ml_dtypes.float8_e4m3fn)
    # FP8 tensors + scales (partial edge blocks)
    for name, shape in {
        "model.layers.0.attention.q_proj.weight": (64, D),
        "model.layers.0.attention.g_proj.weight": (64, D),  # KDA g_proj (full rank) is FP8
        "model.layers.0.attention.dense.weight": (D, 64),
        "model.layers.0.mlp.down_proj.weight": (D, I),
        "model.layers.3.attention.kv_b_proj.weight": (4 * 22, 24),
        "model.layers.3.attention.kv_a_proj_with_mqa.weight": (32, D),
        "model.layers.1.mlp.shared_experts.gate_proj.weight": (Im, D),
    }.items():
        assert raw[name].dtype == f8 and raw[name].shape == shape, name
        sc = raw[name.replace(".weight", ".weight_scale_inv")]
        assert sc.dtype == np.float32 and sc.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)), name
    # not quantized
    bf16 = np.dtype(ml_dtypes.bfloat16)
    for name in (
        "model.word_embeddings.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.attention.b_proj.weight",
        "model.layers.0.attention.o_norm.weight",
        "model.layers.3.attention.g_proj.weight",  # MLA head-wise gate
        "model.layers.3.attention.kv_a_layernorm.weight",
        "model.layers.1.mlp.gate.weight",
    ):
        assert raw[name].dtype == bf16, name
        assert name.replace(".weight", ".weight_scale_inv") not in raw
    for name in (
        "model.layers.0.attention.A_log",
        "model.layers.0.attention.dt_bias",
        "model.layers.0.attention.q_conv1d.weight",
        "model.layers.1.mlp.gate.expert_bias",
    ):
        assert raw[name].dtype == np.float32, name
    np.testing.assert_array_equal(deq["model.layers.0.attention.A_log"], orig["model.layers.0.attention.A_log"])
    # routed experts
    gate = raw["model.layers.2.mlp.experts.7.gate_proj.weight"]
    down = raw["model.layers.2.mlp.experts.7.down_proj.weight"]
    if mxfp4:
        assert gate.dtype == np.uint8 and gate.shape == (Im, D // 2)
        assert raw["model.layers.2.mlp.experts.7.gate_proj.weight_scale_inv"].shape == (Im, D // 32)
        assert raw["model.layers.2.mlp.experts.7.gate_proj.weight_scale_inv"].dtype == ml_dtypes.float8_e8m0fnu
        assert down.dtype == np.uint8 and down.shape == (D, Im // 2)
        assert raw["model.layers.2.mlp.experts.7.down_proj.weight_scale_inv"].shape == (D, math.ceil(Im / 32))
        np.testing.assert_array_equal(
            deq["model.layers.2.mlp.experts.7.gate_proj.weight"],
            dequantize_mxfp4(gate, raw["model.layers.2.mlp.experts.7.gate_proj.weight_scale_inv"]),
        )
    else:
        assert gate.dtype == f8 and gate.shape == (Im, D)
        assert raw["model.layers.2.mlp.experts.7.gate_proj.weight_scale_inv"].shape == (2, 2)
        np.testing.assert_array_equal(
            deq["model.layers.2.mlp.experts.7.gate_proj.weight"],
            dequantize_fp8_block(gate, raw["model.layers.2.mlp.experts.7.gate_proj.weight_scale_inv"]),
        )
