"""ling-convert round trip: oracle -> block-FP8 (and MXFP4) shards -> ling-convert -> load_checkpoint gives the
oracle's logits on the dequantised weights, and the Orbax tree is the model's NNX parameter tree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from checkpoint_factory import make_quantized_checkpoint, read_checkpoint_tensors, write_hf_checkpoint
from flax import nnx
from oracle import build_oracle, load_oracle, oracle_logits, save_oracle

from convert.cli import main
from convert.hooks import to_dense, to_fp8
from convert.source import SourceRows, SourceTensor
from ling_jax.checkpoints.hf import SCALE_SUFFIX
from ling_jax.checkpoints.orbax import load_checkpoint, param_name
from ling_jax.checkpoints.storage import FP8, MXFP4
from ling_jax.quant import dequantize_fp8_block, dequantize_mxfp4
from ling_jax.quantized import BlockFP8Weight, dequantize_blocks
from ling_jax.sharding import make_mesh, param_shardings
from pallas_kernels.compat import checkpoint_tree_metadata

FP32_TOL = 1e-4
KEPT_FP32 = ("A_log", "dt_bias", "conv1d.weight", "expert_bias")  # stay float32 in a bf16 conversion
IDS = np.random.default_rng(0).integers(2, 100, (2, 40))


def rel_error(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def oracle_dirs(tmp_path_factory):
    return {
        name: save_oracle(build_oracle(name, seed=3), tmp_path_factory.mktemp(name))
        for name in ("g2_dense1", "g4_wide")
    }


def _reference_logits(tmp_path, quantized_dir, dequantized: dict, *, bf16: bool) -> np.ndarray:
    """The oracle run on the weights the converted checkpoint holds (see tests/support/oracle.py load_oracle)."""
    config, _ = read_checkpoint_tensors(quantized_dir)
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    if bf16:
        dequantized = {
            name: value if name.endswith(KEPT_FP32) else value.astype(ml_dtypes.bfloat16).astype(np.float32)
            for name, value in dequantized.items()
        }
    write_hf_checkpoint(tmp_path / "reference", config, dequantized)
    return oracle_logits(load_oracle(tmp_path / "reference"), IDS)


@pytest.mark.parametrize(
    "oracle,mxfp4,dtype",
    [("g2_dense1", False, "bf16"), ("g4_wide", True, "bf16"), ("g2_dense1", False, "fp8"), ("g4_wide", True, "fp8")],
)
def test_logits_match_oracle_on_dequantised_weights(oracle_dirs, tmp_path, oracle, mxfp4, dtype):
    hf_dir, orbax_dir = tmp_path / "hf", tmp_path / "orbax"
    dequantized = make_quantized_checkpoint(oracle_dirs[oracle], hf_dir, mxfp4_experts=mxfp4)
    assert main([str(hf_dir), str(orbax_dir), "--dtype", dtype, "--verify", "--quiet"]) == 0
    model = load_checkpoint(orbax_dir, dtype=jnp.float32)
    expected = _reference_logits(tmp_path, hf_dir, dequantized, bf16=dtype == "bf16")
    err = rel_error(nnx.jit(lambda m, ids: m(ids).logits)(model, jnp.asarray(IDS)), expected)
    assert err <= FP32_TOL, f"{oracle} mxfp4={mxfp4} --dtype {dtype}: fp32 logits rel. error {err:.2e}"


def _stored_names(path) -> set[str]:
    tree = checkpoint_tree_metadata(str(path)).tree
    return {".".join(str(k.key) for k in keys) for keys, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_orbax_tree_is_the_nnx_parameter_tree(oracle_dirs, tmp_path):
    hf_dir, orbax_dir = tmp_path / "hf", tmp_path / "orbax"
    make_quantized_checkpoint(oracle_dirs["g4_wide"], hf_dir, mxfp4_experts=True)
    assert main([str(hf_dir), str(orbax_dir), "--dtype", "fp8", "--quiet"]) == 0
    mesh = make_mesh({"expert": 8})
    model = load_checkpoint(orbax_dir, mesh=mesh)
    expected = param_shardings(nnx.state(model), mesh)
    flat = nnx.to_flat_state(nnx.state(model))
    names = {param_name(path) for path, _ in flat}
    experts = "model.layers.1.mlp.experts.gate_proj"
    assert experts in names and "model.layers.0.attention.q_conv1d" in names
    stored = _stored_names(orbax_dir)
    assert names <= stored
    assert {n[: -len(SCALE_SUFFIX)] for n in stored - names} <= names  # the rest are FP8 block scales
    assert experts + SCALE_SUFFIX in stored and "model.layers.0.attention.q_proj.weight" + SCALE_SUFFIX in stored
    for (path, variable), (_, sharding) in zip(flat, nnx.to_flat_state(expected)):
        value = variable.get_value()
        # restored straight into the rules' shardings (a quantised weight's values and scales alike)
        assert jax.tree.map(lambda a: a.sharding, value) == sharding.get_value(), path
        if param_name(path).endswith(("A_log", "dt_bias", "conv1d", "expert_bias")):
            assert value.dtype == jnp.float32, path
        elif isinstance(value, BlockFP8Weight):  # kept as converted: E4M3 values, float32 block scales
            assert (value.values.dtype, value.scales.dtype) == (jnp.float8_e4m3fn, jnp.float32), path
        else:
            assert value.dtype == jnp.bfloat16, path
    gate = model.model.layers[1].mlp.experts.gate_proj.get_value()  # MXFP4 experts, converted to E4M3 codes
    assert isinstance(gate, BlockFP8Weight) and gate.block == (1, 32) and gate.shape == (16, 144, 160)
    assert gate.values.addressable_shards[0].data.shape == (2, 144, 160)  # [E, I, D], E over 8
    assert gate.scales.addressable_shards[0].data.shape == (2, 144, 5)  # per-expert scales split with them
    q_proj = model.model.layers[0].attention.q_proj.weight.get_value()
    assert isinstance(q_proj, BlockFP8Weight) and q_proj.block == (128, 128)
    assert (orbax_dir / "config.json").is_file()


def test_hooks_match_numpy_dequantisation():
    rng = np.random.default_rng(0)
    weight = (rng.integers(0, 256, (300, 200), dtype=np.uint8) & 0xBF).view(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.01, 2.0, (3, 2)).astype(np.float32)
    fp8 = SourceTensor("w", "f", FP8, (300, 200), weight.dtype, 0, "s", (128, 128))
    rows = SourceRows(weight, scale, 0)
    for dtype in (np.float32, ml_dtypes.bfloat16):
        want = dequantize_fp8_block(weight, scale, (128, 128)).astype(dtype)
        got = to_dense(rows, fp8, np.dtype(dtype))
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    packed = rng.integers(0, 256, (48, 72), dtype=np.uint8)
    exponents = rng.integers(110, 140, (48, 5), dtype=np.uint8)
    mxfp4 = SourceTensor("w", "f", MXFP4, (48, 144), packed.dtype, 0, "s", (1, 32))
    rows = SourceRows(packed, np.ldexp(np.float32(1), exponents.astype(np.int32) - 127), 0)
    want = dequantize_mxfp4(packed, exponents)
    np.testing.assert_array_equal(to_dense(rows, mxfp4, np.dtype(np.float32)), want)
    codes, group_scale = to_fp8(rows, mxfp4)
    assert codes.dtype == ml_dtypes.float8_e4m3fn and codes.shape == (48, 144)
    np.testing.assert_array_equal(np.asarray(dequantize_blocks(codes, group_scale, (1, 32), jnp.float32)), want)
