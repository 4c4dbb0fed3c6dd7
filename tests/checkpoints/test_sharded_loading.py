"""`load_hf_checkpoint(mesh=...)` builds every parameter from per-device slices: the sharded model equals the
unsharded one bit for bit (FP8 kept, MXFP4 kept, and dequantised on a mesh that cuts the scale blocks), every
device holds exactly its fraction, and no read of an expert tensor asks for more than one device's slice. The
parameters are read by parallel workers (`pieces.load_all`) within a bound on the host bytes in flight; one worker
or many load the same model. The host buffers slices are read into (`pieces.host_buffer`) are aligned so that jax
keeps them as the CPU device buffer, without a copy."""

from __future__ import annotations

import math
import re
import threading
import time
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from shard_checks import assert_each_device_holds_its_fraction, leaves
from tiny_fp8 import write_tiny_fp8_checkpoint

from ling_jax import load_hf_checkpoint, make_mesh, progress
from ling_jax.checkpoints.pieces import HOST_ALIGNMENT, MAPPED_BYTES, host_buffer, load_all
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


def _assert_bitwise_equal(sharded, unsharded) -> None:
    ours, reference = leaves(sharded), leaves(unsharded)
    assert ours.keys() == reference.keys()
    for name, leaf in ours.items():
        want = np.asarray(reference[name])
        assert leaf.dtype == want.dtype and leaf.shape == want.shape, name
        assert np.array_equal(np.asarray(leaf).view(np.uint8), want.view(np.uint8)), name


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
    assert_each_device_holds_its_fraction(sharded, mesh)
    _assert_bitwise_equal(sharded, _load(checkpoints["fp8"]))


def test_sharded_mxfp4_load_equals_unsharded_bit_for_bit(checkpoints):
    mesh = make_mesh({"expert": 8})
    sharded = _load(checkpoints["mxfp4"], mesh)
    down = sharded.model.layers[1].mlp.experts.down_proj.get_value()
    assert isinstance(down, MXFP4Weight)
    assert {s.data.shape for s in down.values.addressable_shards} == {(4, 64, 16)}  # 4 experts, [D, I / 2] bytes
    assert {s.data.shape for s in down.scales.addressable_shards} == {(4, 64, 1)}  # one scale per 32 inputs
    assert_each_device_holds_its_fraction(sharded, mesh)
    _assert_bitwise_equal(sharded, _load(checkpoints["mxfp4"]))
    dense = _load(checkpoints["mxfp4"], mesh, weights="bf16").model.layers[1].mlp.experts.down_proj.get_value()
    np.testing.assert_array_equal(np.asarray(down.dequantize(jnp.float32)), np.asarray(dense))  # kept == dequantised


def test_dequantised_load_on_a_mesh_that_cuts_scale_blocks(checkpoints):
    """tensor=4 gives each device 8 of an expert's 32 rows: half a 16-row scale block. Kept FP8 is refused,
    dequantised slice by slice it equals the unsharded dequantised model."""
    mesh = make_mesh({"tensor": 4, "expert": 2})
    refusal = r"\.weight: mesh axes \('tensor',\) split .* cuts its 16-element scale blocks.*--weights bf16\)"
    with pytest.raises(ShardingError, match=refusal):
        _load(checkpoints["fp8"], mesh)
    sharded = _load(checkpoints["fp8"], mesh, weights="bf16")
    assert_each_device_holds_its_fraction(sharded, mesh)
    _assert_bitwise_equal(sharded, _load(checkpoints["fp8"], weights="bf16"))


@pytest.mark.parametrize("weights", ["stored", "bf16"])
def test_no_read_asks_for_more_than_one_devices_slice_of_an_expert(checkpoints, weights, monkeypatch):
    """On tensor=2 x expert=4 each expert tensor is held by two devices, each half of it: every read of an expert
    tensor (or its scales) is one such half, read once for the devices sharing it."""
    reads = defaultdict(list)
    read = SafetensorsFile.read

    def recording_read(self, name, index=(), out=None):
        piece = read(self, name, index, out)
        reads[name].append(piece.size / math.prod(self.shape(name)))
        return piece

    monkeypatch.setattr(SafetensorsFile, "read", recording_read)
    _load(checkpoints["fp8"], make_mesh({"tensor": 2, "expert": 4}), weights=weights)
    expert_reads = {name: fractions for name, fractions in reads.items() if EXPERT_TENSOR.search(name)}
    assert len(expert_reads) == 2 * 32 * 3 * 2  # layer 1 and the MTP layer: each expert's gate, up, down and scales
    for name, fractions in expert_reads.items():
        assert fractions == [0.5, 0.5], f"{name}: read {fractions} of it"


def test_one_worker_or_many_load_the_same_model_and_say_how_fast(checkpoints, capsys, monkeypatch):
    monkeypatch.setattr(progress, "LINE_SECONDS", 0.0)  # a pipe's lines from the start (else after 15 s)
    one = load_hf_checkpoint(checkpoints["fp8"], dtype=jnp.float32, progress=True, workers=1)
    line = r"read \d+\.\d\d GiB of parameters in [\d.]+ s \([\d.]+ GB/s, workers=1\)"
    err = capsys.readouterr().err
    assert re.search(line, err)
    assert "\r" not in err and re.search(r"^reading checkpoint: 100%", err, flags=re.M), err  # a pipe: whole lines
    _assert_bitwise_equal(_load(checkpoints["fp8"]), one)


def test_parallel_loads_keep_their_host_bytes_within_the_buffer_and_stop_at_the_first_failure():
    held, peak, lock = [0], [0], threading.Lock()

    def job(i: int, n: int):
        def run():
            with lock:
                held[0] += n
                peak[0] = max(peak[0], held[0])
            time.sleep(0.01)
            with lock:
                held[0] -= n
            return i

        return run

    sizes = [3, 3, 3, 9, 1, 1, 1, 1]
    assert load_all([job(i, n) for i, n in enumerate(sizes)], sizes, workers=4, buffer_bytes=6) == list(range(8))
    assert peak[0] == 9  # the larger job alone; the others at most 6 at once

    started = []

    def failing():
        raise RuntimeError("damaged")

    def later():
        time.sleep(0.05)
        started.append(1)

    with pytest.raises(RuntimeError, match="damaged"):
        load_all([failing, *[later] * 20], [1] * 21, workers=2, buffer_bytes=1)
    assert not started  # a buffer of one job: none started after the failure


@pytest.mark.parametrize("nbytes", [3, MAPPED_BYTES], ids=["heap", "mapped"])
def test_host_buffers_are_aligned_and_become_the_cpu_device_buffer_without_a_copy(nbytes):
    buffer = host_buffer((nbytes // 2, 2), jnp.float8_e4m3fn)
    assert buffer.shape == (nbytes // 2, 2) and buffer.dtype == jnp.float8_e4m3fn and buffer.flags.writeable
    assert buffer.ctypes.data % HOST_ALIGNMENT == 0
    buffer[...] = 1.5
    on_device = jax.device_put(buffer, jax.devices("cpu")[0])
    assert on_device.unsafe_buffer_pointer() == buffer.ctypes.data
    assert np.array_equal(np.asarray(on_device, np.float32), np.full(buffer.shape, 1.5, np.float32))
