"""scripts/make_test_checkpoint.py and the library behind it (convert.synthetic, convert.hf_writer): checkpoints
quantised bit for bit like tests/support/checkpoint_factory.py, sharded with a consistent index, loadable."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from checkpoint_factory import make_quantized_checkpoint, read_checkpoint_raw
from helpers import REPO_ROOT
from oracle import build_oracle, save_oracle

from convert.hf_writer import TensorEntry, _shard_of_each, write_sharded
from convert.synthetic import benchmark_config, checkpoint_tensors, config_dict
from ling_jax.checkpoints.hf import load_hf_checkpoint
from ling_jax.checkpoints.safetensors_io import CheckpointTensors
from ling_jax.checkpoints.storage import storage_kind
from ling_jax.config import LingConfig
from ling_jax.presets import PRESETS

ROOT = str(REPO_ROOT)
SCRIPT = os.path.join(ROOT, "scripts", "make_test_checkpoint.py")


def make_test_checkpoint(*args) -> None:
    subprocess.run([sys.executable, SCRIPT, *map(str, args)], check=True, capture_output=True, text=True)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_config_dict_parses_back_to_the_config(preset):
    config = PRESETS[preset]
    assert LingConfig.from_dict(json.loads(json.dumps(config_dict(config)))) == config


@pytest.mark.parametrize("mxfp4", [False, True])
def test_from_hf_dir_quantises_like_the_test_factory(tmp_path, mxfp4):
    oracle = save_oracle(build_oracle("g4_wide"), tmp_path / "oracle")
    make_quantized_checkpoint(oracle, tmp_path / "factory", mxfp4_experts=mxfp4)
    make_test_checkpoint(
        "--from-hf-dir",
        oracle,
        "--out",
        tmp_path / "script",
        "--shards",
        5,
        *(["--mxfp4-experts", "--mxfp4-scale-format", "float32"] if mxfp4 else []),
    )
    factory_config, factory = read_checkpoint_raw(tmp_path / "factory")
    script_config, script = read_checkpoint_raw(tmp_path / "script")
    assert sorted(factory) == sorted(script)
    for name, value in factory.items():
        assert script[name].dtype == value.dtype and script[name].shape == value.shape, name
        np.testing.assert_array_equal(script[name].view(np.uint8), value.view(np.uint8), err_msg=name)
    quantization, expected = script_config["quantization_config"], factory_config["quantization_config"]
    assert sorted(quantization.pop("modules_to_not_convert")) == sorted(expected.pop("modules_to_not_convert"))
    assert quantization == expected
    index = json.loads((tmp_path / "script" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 5


def test_random_preset_checkpoint_loads(tmp_path):
    make_test_checkpoint("--preset", "tiny", "--out", tmp_path, "--shards", 3, "--mxfp4-experts", "--seed", 7)
    tensors = CheckpointTensors(str(tmp_path))
    expert = "model.layers.1.mlp.experts.0.up_proj.weight"
    assert tensors.dtype(expert) == np.uint8 and tensors.dtype(expert + "_scale_inv") == ml_dtypes.float8_e8m0fnu
    assert tensors.dtype("model.layers.0.attention.q_proj.weight") == ml_dtypes.float8_e4m3fn
    assert tensors.dtype("model.layers.1.attention.g_proj.weight") == ml_dtypes.bfloat16  # MLA head-wise gate
    assert tensors.dtype("model.layers.0.attention.A_log") == np.float32
    assert "model.layers.4.eh_proj.weight_scale_inv" in tensors  # the MTP layer
    model = load_hf_checkpoint(tmp_path, dtype=jnp.float32, progress=False)
    logits = model(jnp.array([[5, 9, 200, 3]])).logits
    assert np.isfinite(np.asarray(logits)).all()


def test_storage_kinds_follow_the_spec():
    config = PRESETS["tiny"]
    kinds = {name: storage_kind(name, config, mxfp4_experts=True) for name, _ in checkpoint_tensors(config)}
    assert kinds["model.word_embeddings.weight"] == kinds["lm_head.weight"] == "bf16"
    assert kinds["model.layers.0.attention.b_proj.weight"] == kinds["model.layers.2.mlp.gate.weight"] == "bf16"
    assert kinds["model.layers.0.attention.g_proj.weight"] == "fp8"  # KDA gate; the MLA one stays bf16
    assert kinds["model.layers.0.attention.q_conv1d.weight"] == kinds["model.layers.2.mlp.gate.expert_bias"] == "fp32"
    assert kinds["model.layers.2.mlp.shared_experts.down_proj.weight"] == "fp8"
    assert kinds["model.layers.2.mlp.experts.15.down_proj.weight"] == "mxfp4"
    assert kinds["model.layers.4.eh_proj.weight"] == kinds["model.layers.0.mlp.down_proj.weight"] == "fp8"


def test_shards_are_contiguous_balanced_and_never_empty(tmp_path):
    entries = [TensorEntry(f"t{i}", np.dtype(np.float32), (n,)) for i, n in enumerate([1000, 10, 10, 10, 3000, 5])]
    owners = _shard_of_each(entries, 4)
    assert owners == sorted(owners) and set(owners) == {0, 1, 2, 3}
    values = [np.full(entry.shape, i, np.float32) for i, entry in enumerate(entries)]
    arrays = ((entry.name, value) for entry, value in zip(entries, values, strict=True))
    write_sharded(str(tmp_path), {"a": 1}, entries, arrays, num_shards=4)
    tensors = CheckpointTensors(str(tmp_path))
    for entry, value in zip(entries, values, strict=True):
        np.testing.assert_array_equal(tensors.get(entry.name), value)
    with pytest.raises(ValueError, match="t1"):
        write_sharded(str(tmp_path / "bad"), {}, entries, iter([("t0", values[0]), ("t2", values[2])]), num_shards=2)


def test_benchmark_config_reaches_its_size():
    config = benchmark_config(2.3e9)
    sizes = {"fp8": 1, "bf16": 2, "fp32": 4}
    total = sum(
        int(np.prod(shape)) * sizes[storage_kind(name, config, False)] for name, shape in checkpoint_tensors(config)
    )
    assert 2.0e9 <= total <= 2.8e9
