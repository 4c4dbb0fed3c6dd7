"""`ling-convert --mesh`: the target mesh is checked against the model, the stored chunks divide every
device's rows, the mesh is recorded, and the checkpoint restores onto that mesh unchanged."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from flax import nnx

from convert.cli import main
from convert.plan import build_plan
from convert.synthetic import write_random_checkpoint
from ling_jax.checkpoints.hf import TensorResolver
from ling_jax.checkpoints.orbax import LAYOUT_FILE, load_checkpoint
from ling_jax.checkpoints.safetensors_io import CheckpointTensors
from ling_jax.presets import preset
from ling_jax.sharding import make_mesh

MESH = {"tensor": 2, "expert": 4}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    # the vocabulary splits over tensor=2; KDA width 4 x 128 and expert width 256 span several 128-row FP8 blocks
    config = preset("tiny").replace(vocab_size=264, head_dim=128, moe_intermediate_size=256)
    directory = tmp_path_factory.mktemp("hf")
    write_random_checkpoint(str(directory), config, num_shards=2)
    return config, directory


def test_chunks_divide_each_devices_rows(source):
    config, directory = source
    plans = {
        p.name: p for p in build_plan(TensorResolver(CheckpointTensors(str(directory)), config), config, "bf16", MESH)
    }
    assert plans["model.layers.0.attention.q_proj.weight"].rows_per_slice == 256  # 512 rows over tensor=2
    assert plans["model.layers.1.mlp.experts.gate_proj"].rows_per_slice == 128  # [E, 256, D], per expert
    assert plans["lm_head.weight"].rows_per_slice == 132  # stored bf16 (no 128-row blocks): 264 rows over 2


def test_converted_on_a_mesh_restores_onto_it(source, tmp_path):
    config, directory = source
    plain, meshed = tmp_path / "plain", tmp_path / "meshed"
    assert main([str(directory), str(plain), "--quiet"]) == 0
    assert main([str(directory), str(meshed), "--mesh", "tensor=2,expert=4", "--quiet"]) == 0
    assert json.loads((meshed / LAYOUT_FILE).read_text())["mesh"] == MESH
    mesh = make_mesh(MESH)
    restored = nnx.to_flat_state(nnx.state(load_checkpoint(meshed, mesh=mesh)))
    reference = nnx.to_flat_state(nnx.state(load_checkpoint(plain)))
    for (path, ours), (_, ref) in zip(restored, reference):
        np.testing.assert_array_equal(np.asarray(ours.get_value()), np.asarray(ref.get_value()), err_msg=str(path))
    gate = dict(restored)[("model", "layers", 1, "mlp", "experts", "gate_proj")].get_value()
    assert gate.addressable_shards[0].data.shape == (
        config.num_experts // 4,
        config.moe_intermediate_size // 2,
        config.hidden_size,
    )


@pytest.mark.parametrize(
    "mesh, message",
    [
        ("expert=3", "dimension 'experts' of size 16 is not divisible by mesh axes \\('expert',\\)"),
        ("tensor:2", "--mesh expects axis=size pairs"),
        ("pipeline=2", "unknown mesh axes"),
    ],
)
def test_bad_mesh_is_refused_before_writing(source, tmp_path, capsys, mesh, message):
    _, directory = source
    assert main([str(directory), str(tmp_path / "out"), "--mesh", mesh, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ling-convert: error: ") and re.search(message, err), err
    assert not (tmp_path / "out").exists()
