"""A broken checkpoint fails loudly: every error names the offending tensor (or key) and the file it is in."""

import json
import os
import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from checkpoint_factory import (
    make_quantized_checkpoint,
    read_checkpoint_raw,
    read_checkpoint_tensors,
    write_hf_checkpoint,
)
from flax import nnx
from oracle import build_oracle, save_oracle

from ling_jax.checkpoints.hf import CheckpointError, load_hf_checkpoint

INDEX = "model.safetensors.index.json"
KV_B = "model.layers.1.attention.kv_b_proj.weight"
EXPERT_UP = "model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.fixture(scope="module")
def oracle_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("oracle_g2_dense1")
    save_oracle(build_oracle("g2_dense1"), path)
    return path


@pytest.fixture(scope="module")
def oracle(oracle_dir):
    """(config dict, name -> float32) of the oracle checkpoint; tests copy before editing."""
    return read_checkpoint_tensors(oracle_dir)


@pytest.fixture(scope="module")
def quantized(oracle_dir, tmp_path_factory):
    """(config dict, name -> stored array) of a block-FP8 copy of the oracle."""
    path = tmp_path_factory.mktemp("fp8")
    make_quantized_checkpoint(oracle_dir, path)
    return read_checkpoint_raw(path)


def _write(path, config, tensors, num_shards=3):
    write_hf_checkpoint(path, config, tensors, num_shards=num_shards)
    return path


def _shard_of(path, name) -> str:
    weight_map = json.loads((path / INDEX).read_text())["weight_map"]
    return str(path / weight_map[name])


def _load(path):
    return load_hf_checkpoint(path, dtype=jnp.float32, progress=False)


@nnx.jit
def _logits(model, ids_BT):
    return model(ids_BT).logits


IDS = jnp.array([[3, 17, 5, 99, 42, 7, 1, 64]], jnp.int32)


# ------------------------------------------------------------------------------------------------ positive
def test_oracle_checkpoint_loads(oracle_dir, oracle):
    _, tensors = oracle
    model = _load(oracle_dir)
    np.testing.assert_array_equal(np.asarray(model.model.layers[1].attention.kv_b_proj.weight[...]), tensors[KV_B])
    stacked = np.asarray(model.model.layers[1].mlp.experts.up_proj[...])
    np.testing.assert_array_equal(stacked[3], tensors[EXPERT_UP])
    assert np.isfinite(np.asarray(_logits(model, IDS))).all()


def test_hf_aliases_load_identically(oracle_dir, oracle, tmp_path):
    config, tensors = oracle
    renamed = {}
    for name, value in tensors.items():
        name = name.replace(".attention.dense.", ".attention.o_proj.")
        name = re.sub(r"\.mlp\.gate\.expert_bias$", ".mlp.gate.e_score_correction_bias", name)
        renamed[name] = value
    assert any(".o_proj." in n for n in renamed) and any("e_score_correction_bias" in n for n in renamed)
    assert not any(".attention.dense." in n or n.endswith("expert_bias") for n in renamed)
    reference, aliased = _load(oracle_dir), _load(_write(tmp_path, config, renamed))
    for (path_a, a), (path_b, b) in zip(
        nnx.to_flat_state(nnx.state(reference)), nnx.to_flat_state(nnx.state(aliased)), strict=True
    ):
        assert path_a == path_b
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path_a))
    np.testing.assert_array_equal(np.asarray(_logits(reference, IDS)), np.asarray(_logits(aliased, IDS)))


def test_quantized_checkpoint_loads(quantized, tmp_path):
    config, tensors = quantized
    _load(_write(tmp_path, config, tensors))


# ------------------------------------------------------------------------------------------------ tensors
@pytest.mark.parametrize("name", [KV_B, EXPERT_UP, "model.layers.0.attention.A_log", "lm_head.weight"])
def test_missing_tensor(oracle, tmp_path, name):
    config, tensors = oracle
    _write(tmp_path, config, {k: v for k, v in tensors.items() if k != name})
    with pytest.raises(CheckpointError) as info:
        _load(tmp_path)
    message = str(info.value)
    assert name in message and str(tmp_path) in message


@pytest.mark.parametrize(
    "name", [KV_B, "model.layers.0.attention.q_proj.weight", "model.layers.2.mlp.experts.0.down_proj.weight"]
)
def test_wrong_shape(oracle, tmp_path, name):
    config, tensors = oracle
    tensors = {**tensors, name: np.ascontiguousarray(tensors[name].T)}
    _write(tmp_path, config, tensors)
    with pytest.raises(CheckpointError) as info:
        _load(tmp_path)
    message = str(info.value)
    assert name in message and _shard_of(tmp_path, name) in message
    assert str(list(tensors[name].shape)) in message


def test_wrong_shape_of_conv(oracle, tmp_path):
    config, tensors = oracle
    name = "model.layers.2.attention.k_conv1d.weight"
    tensors = {**tensors, name: tensors[name][:, 0, :]}  # [C, K] instead of [C, 1, K]
    _write(tmp_path, config, tensors)
    with pytest.raises(CheckpointError) as info:
        _load(tmp_path)
    assert name in str(info.value) and _shard_of(tmp_path, name) in str(info.value)


def test_unknown_extra_tensor(oracle, tmp_path):
    config, tensors = oracle
    name = "model.layers.0.attention.bogus.weight"
    _write(tmp_path, config, {**tensors, name: np.zeros((4, 4), np.float32)})
    with pytest.raises(CheckpointError) as info:
        _load(tmp_path)
    message = str(info.value)
    assert name in message and str(tmp_path) in message
    assert os.path.basename(_shard_of(tmp_path, name)) in message


def test_extra_layer_is_unknown(oracle, tmp_path):
    """Tensors of a layer index the config does not have (an MTP layer with num_nextn_predict_layers=0)."""
    config, tensors = oracle
    name = "model.layers.4.eh_proj.weight"
    _write(tmp_path, config, {**tensors, name: np.zeros((64, 128), np.float32)})
    with pytest.raises(CheckpointError, match=re.escape(name)):
        _load(tmp_path)


def test_fp8_weight_without_scale(quantized, tmp_path):
    config, tensors = quantized
    assert tensors[KV_B].dtype == ml_dtypes.float8_e4m3fn
    scale = KV_B + "_scale_inv"
    assert scale in tensors
    _write(tmp_path, config, {k: v for k, v in tensors.items() if k != scale})
    with pytest.raises(CheckpointError) as info:
        _load(tmp_path)
    message = str(info.value)
    assert KV_B in message and scale in message and _shard_of(tmp_path, KV_B) in message


def test_fp8_scale_of_wrong_block_shape(quantized, tmp_path):
    config, tensors = quantized
    scale = KV_B + "_scale_inv"
    assert tensors[scale].shape == (1, 1)  # [44, 24] weight: one partial 128x128 block
    _write(tmp_path, config, {**tensors, scale: np.ones((2, 1), np.float32)})
    with pytest.raises(CheckpointError) as info:
        _load(tmp_path)
    message = str(info.value)
    assert scale in message and _shard_of(tmp_path, scale) in message
    assert "(2, 1)" in message and "(1, 1)" in message


def test_non_float_dtype(oracle, tmp_path):
    config, tensors = oracle
    name = "model.layers.1.post_attention_layernorm.weight"
    _write(tmp_path, config, {**tensors, name: np.ones(tensors[name].shape, np.int32)})
    with pytest.raises(CheckpointError) as info:
        _load(tmp_path)
    message = str(info.value)
    assert name in message and _shard_of(tmp_path, name) in message and "int32" in message


# ------------------------------------------------------------------------------------------------ files
def test_shard_missing_on_disk(oracle, tmp_path):
    config, tensors = oracle
    _write(tmp_path, config, tensors)
    shard = "model-00002-of-00003.safetensors"
    (tmp_path / shard).unlink()
    with pytest.raises(FileNotFoundError) as info:
        _load(tmp_path)
    message = str(info.value)
    assert shard in message and str(tmp_path / INDEX) in message


def test_truncated_shard(oracle, tmp_path):
    config, tensors = oracle
    _write(tmp_path, config, tensors)
    shard = tmp_path / "model-00003-of-00003.safetensors"
    data = shard.read_bytes()
    (header_len,) = np.frombuffer(data[:8], "<u8")
    header = json.loads(data[8 : 8 + int(header_len)])
    header.pop("__metadata__", None)
    last = max(header, key=lambda n: header[n]["data_offsets"][1])
    shard.write_bytes(data[:-16])
    with pytest.raises(ValueError) as info:
        _load(tmp_path)
    message = str(info.value)
    assert last in message and str(shard) in message


def test_config_missing_required_key(oracle, tmp_path):
    config, tensors = oracle
    _write(tmp_path, {k: v for k, v in config.items() if k != "kv_lora_rank"}, tensors)
    with pytest.raises(ValueError) as info:
        _load(tmp_path)
    message = str(info.value)
    assert "kv_lora_rank" in message and str(tmp_path / "config.json") in message


def test_nonexistent_directory(tmp_path):
    missing = tmp_path / "no_such_checkpoint"
    with pytest.raises(FileNotFoundError) as info:
        _load(missing)
    assert str(missing) in str(info.value)
