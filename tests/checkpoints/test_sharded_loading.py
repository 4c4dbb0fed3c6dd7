"""`load_hf_checkpoint(mesh=...)` builds every parameter from per-device slices: the sharded model equals the
unsharded one bit for bit (FP8 kept, MXFP4 kept, and dequantised on a mesh that cuts the scale blocks), every
device holds exactly its fraction, and no read of an expert tensor asks for more than one device's slice."""

from __future__ import annotations

import math
import re
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_fp8 import write_tiny_fp8_checkpoint

from ling_jax import load_hf_checkpoint, make_mesh
from ling_jax.checkpoints.safetensors_io import SafetensorsFile
from ling_jax.quantized import BlockFP8Weight, MXFP4Weight
from ling_jax.sharding import ShardingError

EXPERT_TENSOR = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight(_scale_inv)?$")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    directories = {}
    for kind in ("fp8", "mxfp4"):
        directories[kind] = tmp_path_factory.mktemp(kind)
        write_tiny_fp8_checkpoint(directories[kind], mxfp4_experts=kind == "mxfp4")
    return directories


def _load(directory, mesh=None, weights="stored"):
    return load_hf_checkpoint(directory, mesh=mesh, dtype=jnp.float32, weights=weights, progress=False)


def _leaves(model) -> dict[str, jax.Array]:
    flat = jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in flat}


def _assert_bitwise_equal(sharded, unsharded) -> None:
    ours, reference = _leaves(sharded), _leaves(unsharded)
    assert ours.keys() == reference.keys()
    for name, leaf in ours.items():
        want = np.asarray(reference[name])
        assert leaf.dtype == want.dtype and leaf.shape == want.shape, name
        assert np.array_equal(np.asarray(leaf).view(np.uint8), want.view(np.uint8)), name


def _assert_each_device_holds_its_fraction(model, mesh) -> None:
    """Every leaf: one piece per device, each of the global shape divided by the mesh axes its spec names."""
    for name, leaf in _leaves(model).items():
        spec = leaf.sharding.spec
        ways = [
            math.prod(mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else entry or ()))
            for entry in (*spec, *(None,) * (leaf.ndim - len(spec)))
        ]
        expected = tuple(size // n for size, n in zip(leaf.shape, ways))
        assert len(leaf.addressable_shards) == mesh.size, name
        assert {shard.data.shape for shard in leaf.addressable_shards} == {expected}, name


@pytest.mark.parametrize(
    "shape", [{"tensor": 2, "expert": 4}, {"fsdp": 2, "tensor": 2, "expert": 2}], ids=lambda s: str(s)
)
def test_sharded_fp8_load_equals_unsharded_bit_for_bit(checkpoints, shape):
    mesh = make_mesh(shape)
    sharded = _load(checkpoints["fp8"], mesh)
    up = sharded.model.layers[1].mlp.experts.up_proj.get_value()
    assert isinstance(up, BlockFP8Weight) and up.values.dtype == jnp.float8_e4m3fn
    expected = (32 // shape["expert"], 32 // shape["tensor"], 64 // shape.get("fsdp", 1))
    assert {s.data.shape for s in up.values.addressable_shards} == {expected}  # [E, I, D] experts over expert
    scales = (expected[0], 2 // shape["tensor"], 4 // shape.get("fsdp", 1))  # [E, I / 16, D / 16], split alike
    assert {s.data.shape for s in up.scales.addressable_shards} == {scales}
    _assert_each_device_holds_its_fraction(sharded, mesh)
    _assert_bitwise_equal(sharded, _load(checkpoints["fp8"]))


def test_sharded_mxfp4_load_equals_unsharded_bit_for_bit(checkpoints):
    mesh = make_mesh({"expert": 8})
    sharded = _load(checkpoints["mxfp4"], mesh)
    down = sharded.model.layers[1].mlp.experts.down_proj.get_value()
    assert isinstance(down, MXFP4Weight)
    assert {s.data.shape for s in down.values.addressable_shards} == {(4, 64, 16)}  # 4 experts, [D, I / 2] bytes
    assert {s.data.shape for s in down.scales.addressable_shards} == {(4, 64, 1)}  # one scale per 32 inputs
    _assert_each_device_holds_its_fraction(sharded, mesh)
    _assert_bitwise_equal(sharded, _load(checkpoints["mxfp4"]))


def test_dequantised_load_on_a_mesh_that_cuts_scale_blocks(checkpoints):
    """tensor=4 gives each device 8 of an expert's 32 rows: half a 16-row scale block. Kept FP8 is refused,
    dequantised slice by slice it equals the unsharded dequantised model."""
    mesh = make_mesh({"tensor": 4, "expert": 2})
    refusal = r"\.weight: mesh axes \('tensor',\) split .* cuts its 16-element scale blocks"
    with pytest.raises(ShardingError, match=refusal):
        _load(checkpoints["fp8"], mesh)
    sharded = _load(checkpoints["fp8"], mesh, weights="bf16")
    _assert_each_device_holds_its_fraction(sharded, mesh)
    _assert_bitwise_equal(sharded, _load(checkpoints["fp8"], weights="bf16"))


@pytest.mark.parametrize("weights", ["stored", "bf16"])
def test_no_read_asks_for_more_than_one_devices_slice_of_an_expert(checkpoints, weights, monkeypatch):
    """On tensor=2 x expert=4 each expert tensor is held by two devices, each half of it: every read of an expert
    tensor (or its scales) is one such half, read once for the devices sharing it."""
    reads = defaultdict(list)
    read = SafetensorsFile.read

    def recording_read(self, name, index=()):
        piece = read(self, name, index)
        reads[name].append(piece.size / math.prod(self.shape(name)))
        return piece

    monkeypatch.setattr(SafetensorsFile, "read", recording_read)
    _load(checkpoints["fp8"], make_mesh({"tensor": 2, "expert": 4}), weights=weights)
    expert_reads = {name: fractions for name, fractions in reads.items() if EXPERT_TENSOR.search(name)}
    assert len(expert_reads) == 2 * 32 * 3 * 2  # layer 1 and the MTP layer: each expert's gate, up, down and scales
    for name, fractions in expert_reads.items():
        assert fractions == [0.5, 0.5], f"{name}: read {fractions} of it"
