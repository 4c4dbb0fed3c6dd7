"""ling-convert refuses bad input: a clear error naming the file and tensor (or key, or flag), exit status 2,
and nothing at DST."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from checkpoint_factory import make_quantized_checkpoint, read_checkpoint_raw, write_hf_checkpoint
from oracle import build_oracle, save_oracle

from convert.cli import main
from convert.workspace import Workspace
from ling_jax.checkpoints.orbax import load_checkpoint

INDEX = "model.safetensors.index.json"
KV_B = "model.layers.1.attention.kv_b_proj.weight"
NORM = "model.layers.1.post_attention_layernorm.weight"


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(config dict, name -> stored array) of a block-FP8 copy of the g2_dense1 oracle; tests copy before editing."""
    oracle_dir = save_oracle(build_oracle("g2_dense1"), tmp_path_factory.mktemp("oracle"))
    path = tmp_path_factory.mktemp("fp8")
    make_quantized_checkpoint(oracle_dir, path)
    return read_checkpoint_raw(path)


def _write(tmp_path, config, tensors):
    src = tmp_path / "src"
    write_hf_checkpoint(src, config, tensors, num_shards=3)
    return src


def _shard_of(src, name) -> str:
    return str(src / json.loads((src / INDEX).read_text())["weight_map"][name])


def _refused(capsys, tmp_path, src, *flags, dst_name="dst") -> str:
    """Run ling-convert, check it failed without creating DST, and return its error message."""
    dst = tmp_path / dst_name
    assert main([str(src), str(dst), "--quiet", *flags]) == 2
    assert not dst.exists()
    err = capsys.readouterr().err
    assert err.startswith("ling-convert: error: "), err
    return err


def test_truncated_shard(quantized, tmp_path, capsys):
    src = _write(tmp_path, *quantized)
    shard = src / "model-00003-of-00003.safetensors"
    data = shard.read_bytes()
    header = json.loads(data[8 : 8 + int(np.frombuffer(data[:8], "<u8")[0])])
    last = max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])
    shard.write_bytes(data[:-16])
    err = _refused(capsys, tmp_path, src)
    assert last in err and str(shard) in err and "truncated" in err


def test_shard_missing_from_disk(quantized, tmp_path, capsys):
    src = _write(tmp_path, *quantized)
    (src / "model-00002-of-00003.safetensors").unlink()
    err = _refused(capsys, tmp_path, src)
    assert "model-00002-of-00003.safetensors" in err and str(src / INDEX) in err


def test_tensor_missing_from_every_shard(quantized, tmp_path, capsys):
    config, tensors = quantized
    src = _write(tmp_path, config, {k: v for k, v in tensors.items() if k not in (KV_B, KV_B + "_scale_inv")})
    err = _refused(capsys, tmp_path, src)
    assert KV_B in err and "missing from every shard" in err and str(src) in err


def test_fp8_weight_without_scale(quantized, tmp_path, capsys):
    config, tensors = quantized
    src = _write(tmp_path, config, {k: v for k, v in tensors.items() if k != KV_B + "_scale_inv"})
    err = _refused(capsys, tmp_path, src)
    assert KV_B in err and KV_B + "_scale_inv" in err and _shard_of(src, KV_B) in err


def test_scale_of_wrong_block_shape(quantized, tmp_path, capsys):
    config, tensors = quantized
    scale = KV_B + "_scale_inv"
    assert tensors[scale].shape == (1, 1)
    src = _write(tmp_path, config, {**tensors, scale: np.ones((2, 1), np.float32)})
    err = _refused(capsys, tmp_path, src)
    assert scale in err and _shard_of(src, scale) in err and "(2, 1)" in err and "(1, 1)" in err


def test_wrong_dtype(quantized, tmp_path, capsys):
    config, tensors = quantized
    src = _write(tmp_path, config, {**tensors, NORM: np.ones(tensors[NORM].shape, np.int32)})
    err = _refused(capsys, tmp_path, src)
    assert NORM in err and _shard_of(src, NORM) in err and "int32" in err


def test_config_and_tensor_shapes_disagree(quantized, tmp_path, capsys):
    config, tensors = quantized
    src = _write(tmp_path, config, {**tensors, KV_B: np.ascontiguousarray(tensors[KV_B].T)})
    err = _refused(capsys, tmp_path, src)
    assert KV_B in err and _shard_of(src, KV_B) in err and str(list(tensors[KV_B].shape)) in err


def test_tensor_the_config_does_not_use(quantized, tmp_path, capsys):
    config, tensors = quantized
    name = "model.layers.0.attention.bogus.weight"
    src = _write(tmp_path, config, {**tensors, name: np.zeros((4, 4), np.float32)})
    err = _refused(capsys, tmp_path, src)
    assert name in err and "not used by the config" in err


def test_config_missing_a_key(quantized, tmp_path, capsys):
    config, tensors = quantized
    src = _write(tmp_path, {k: v for k, v in config.items() if k != "kv_lora_rank"}, tensors)
    err = _refused(capsys, tmp_path, src)
    assert "kv_lora_rank" in err and str(src / "config.json") in err


@pytest.mark.parametrize(
    "name,poison",
    [
        (
            KV_B,
            lambda fp8: np.where(np.arange(fp8.size).reshape(fp8.shape) == 5, np.uint8(0x7F), fp8.view(np.uint8)).view(
                ml_dtypes.float8_e4m3fn
            ),
        ),  # an E4M3 NaN code
        (
            NORM,
            lambda bf16: np.where(np.arange(bf16.size) == 3, np.float32(np.inf), bf16.astype(np.float32)).astype(
                ml_dtypes.bfloat16
            ),
        ),
    ],
)
def test_nan_or_inf_fails_verification(quantized, tmp_path, capsys, name, poison):
    config, tensors = quantized
    src = _write(tmp_path, config, {**tensors, name: poison(tensors[name])})
    err = _refused(capsys, tmp_path, src, "--verify")
    assert name in err and _shard_of(src, name) in err and "NaN or Inf" in err


def test_finished_destination_needs_overwrite(quantized, tmp_path, capsys):
    src = _write(tmp_path, *quantized)
    dst = tmp_path / "dst"
    assert main([str(src), str(dst), "--quiet"]) == 0
    assert main([str(src), str(dst), "--quiet", "--dtype", "fp8"]) == 2
    err = capsys.readouterr().err
    assert str(dst) in err and "finished checkpoint" in err and "--overwrite" in err
    assert main([str(src), str(dst), "--quiet", "--dtype", "fp8", "--overwrite"]) == 0
    assert json.loads((dst / "ling_convert.json").read_text())["scale_blocks"]  # the fp8 conversion replaced it
    load_checkpoint(dst)
    assert not any(p.name.startswith(".dst.") for p in tmp_path.iterdir())


def test_unfinished_conversion_needs_resume_or_overwrite(quantized, tmp_path, capsys):
    src = _write(tmp_path, *quantized)
    dst = tmp_path / "dst"
    workspace = Workspace(str(dst))
    workspace.prepare({"source": str(src), "dtype": "bf16", "process_count": 1}, resume=False, overwrite=False)
    err = _refused(capsys, tmp_path, src)
    assert workspace.path in err and "--resume" in err and "--overwrite" in err
    err = _refused(capsys, tmp_path, src, "--resume", "--dtype", "fp8")
    assert "'dtype': 'bf16'" in err and "--overwrite" in err
    assert main([str(src), str(dst), "--quiet", "--resume"]) == 0
    load_checkpoint(dst)


def test_bad_flags(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path), str(tmp_path / "dst"), "--workers", "0"])
    assert exit_info.value.code == 2 and "--workers" in capsys.readouterr().err
    err = _refused(capsys, tmp_path, tmp_path / "no_such_checkpoint")
    assert str(tmp_path / "no_such_checkpoint") in err
    a_file = tmp_path / "model.safetensors"
    a_file.write_bytes(b"not a directory")
    err = _refused(capsys, tmp_path, a_file)
    assert f"{a_file}: is a file" in err and "checkpoint directory" in err
