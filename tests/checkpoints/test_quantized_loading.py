"""`load_hf_checkpoint(weights="stored")` keeps block-FP8 weights and MXFP4 experts quantised on the device, and
the weight-only path computes what the oracle computes on the dequantised weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from checkpoint_factory import make_quantized_checkpoint, read_checkpoint_tensors, write_hf_checkpoint
from flax import nnx
from helpers import rel_error
from oracle import build_oracle, load_oracle, oracle_logits, save_oracle

from ling_jax import ExecutionPolicy, LingConfig, load_checkpoint, load_hf_checkpoint, make_mesh, shard_model
from ling_jax.layers import params_of
from ling_jax.moe.block import moe_block
from ling_jax.quantized import BlockFP8Weight, MXFP4Weight
from ling_jax.training.train import TrainConfig, init_train_state

TOL_F32 = 1e-4
BLOCK = (16, 16)  # g2_dense1 is 64 wide: 16 x 16 blocks give every weight a grid of scales
IDS = np.random.default_rng(0).integers(2, 100, (2, 24))
forward = nnx.jit(lambda model, ids_BT: model(ids_BT).logits)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (checkpoint directory, the oracle's logits on its dequantised weights) for an FP8 checkpoint and
    one with MXFP4 routed experts."""
    oracle_dir = save_oracle(build_oracle("g2_dense1", seed=1), tmp_path_factory.mktemp("oracle"))
    cases = {}
    for kind in ("fp8", "mxfp4"):
        directory = tmp_path_factory.mktemp(kind)
        dequantized = make_quantized_checkpoint(
            oracle_dir, directory, block=BLOCK, mxfp4_experts=kind == "mxfp4", mxfp4_scale_format="e8m0"
        )
        config, _ = read_checkpoint_tensors(directory)
        reference = tmp_path_factory.mktemp(f"{kind}_dequantized")
        write_hf_checkpoint(reference, {k: v for k, v in config.items() if k != "quantization_config"}, dequantized)
        cases[kind] = directory, oracle_logits(load_oracle(reference), IDS)
    return cases


def _load(directory, weights="stored"):
    return load_hf_checkpoint(directory, dtype=jnp.float32, weights=weights, progress=False)


@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_weight_only_path_matches_the_dequantised_checkpoint(checkpoints, kind):
    directory, expected = checkpoints[kind]
    stored, dense = _load(directory), _load(directory, "bf16")
    experts_type = MXFP4Weight if kind == "mxfp4" else BlockFP8Weight
    assert isinstance(stored.model.layers[1].mlp.experts.up_proj.get_value(), experts_type)
    assert not isinstance(dense.model.layers[1].mlp.experts.up_proj.get_value(), experts_type)
    x_BTD = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, 64)), jnp.float32)
    moe = jax.jit(lambda w: moe_block(w, x_BTD, stored.config, layer=1))
    errors = {
        "MoE block (routed + shared experts)": rel_error(
            moe(params_of(stored.model.layers[1].mlp)), moe(params_of(dense.model.layers[1].mlp))
        ),
        "logits vs dequantised": rel_error(forward(stored, IDS), forward(dense, IDS)),
        "logits vs oracle": rel_error(forward(stored, IDS), expected),
    }
    for label, err in errors.items():
        print(f"[quantized loading] {kind} {label}: fp32 rel err {err:.2e}")
        assert err <= TOL_F32, f"{kind} {label}: {err:.2e}"


def test_stored_weights_stay_quantised_on_one_device_and_on_a_mesh(checkpoints):
    directory, _ = checkpoints["mxfp4"]
    model = _load(directory)
    q_proj = model.model.layers[0].attention.q_proj.weight.get_value()  # [2 heads * 16, 64] KDA query, block FP8
    assert isinstance(q_proj, BlockFP8Weight) and q_proj.block == BLOCK
    assert q_proj.values.dtype == jnp.float8_e4m3fn and q_proj.values.nbytes == 32 * 64
    assert q_proj.scales.dtype == jnp.float32 and q_proj.scales.nbytes == 2 * 4 * 4
    assert q_proj.values.devices() == q_proj.scales.devices() == {jax.devices()[0]}
    up = model.model.layers[1].mlp.experts.up_proj.get_value()  # [16 experts, 48, 64] MXFP4
    assert up.values.dtype == jnp.uint8 and up.values.nbytes == 16 * 48 * 32
    assert up.scales.dtype == ml_dtypes.float8_e8m0fnu and up.scales.nbytes == 16 * 48 * 2
    one_device = forward(model, IDS)

    mesh = make_mesh({"expert": 8})
    shard_model(model, mesh)
    up = model.model.layers[1].mlp.experts.up_proj.get_value()
    assert up.values.dtype == jnp.uint8 and len(up.values.devices()) == 8
    assert [s.data.nbytes for s in up.values.addressable_shards] == [2 * 48 * 32] * 8  # 2 experts a device
    assert [s.data.shape for s in up.scales.addressable_shards] == [(2, 48, 2)] * 8  # their scales with them
    with jax.set_mesh(mesh):
        err = rel_error(forward(model, IDS), one_device)
    print(f"[quantized loading] expert-parallel over 8 devices vs one: fp32 rel err {err:.2e}")
    assert err <= TOL_F32


def test_refused_requests(checkpoints, tmp_path):
    directory, _ = checkpoints["fp8"]
    for load in (load_hf_checkpoint, load_checkpoint):
        with pytest.raises(ValueError, match=rf"{load.__name__}: dtype=float8_e4m3fn is not a model dtype"):
            load(directory, dtype=jnp.float8_e4m3fn)
        with pytest.raises(ValueError, match=rf"{load.__name__}: weights='fp8'; expected 'stored' .* or 'bf16'"):
            load(directory, weights="fp8")
    with pytest.raises(ValueError, match=r"init_train_state: parameter 'model\.\S+' is a quantised weight"):
        init_train_state(_load(directory), TrainConfig())


def test_generate_cli_weights_flag_reaches_the_loader(checkpoints, capsys):
    from ling_jax.generation import cli, cli_checks

    directory = checkpoints["fp8"][0]
    source = cli_checks.ModelSource(LingConfig.from_pretrained(directory), None, "--model", path=directory)
    for flag, kept in (([], True), (["--weights", "bf16"], False)):
        args = cli.build_parser().parse_args([*flag, "x"])
        model = cli.load_model(source, jnp.float32, None, ExecutionPolicy(), args.weights, verbose=False)
        assert isinstance(model.model.layers[1].mlp.experts.up_proj.get_value(), BlockFP8Weight) is kept
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--weights", "fp4", "x"])
    assert "argument --weights: invalid choice: 'fp4'" in capsys.readouterr().err
