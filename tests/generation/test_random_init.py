"""`random_model`: a random preset initialised by jitted programs straight into its shardings (each device computes
its own slice; nothing whole on device 0), with the model's own initial values, FP8 where a published checkpoint
stores FP8; one program per kind of layer, run once per layer of that kind."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from helpers import rel_error
from shard_checks import assert_each_device_holds_its_fraction, leaves
from tiny_fp8 import sharding_test_config

from ling_jax import LingForCausalLM, make_mesh
from ling_jax.generation.random_init import FP8_INIT_RANGE, random_model
from ling_jax.quantized import BlockFP8Weight


def test_random_fp8_preset_comes_out_sharded_with_the_models_initial_values(capsys):
    # layer 2 is initialised by layer 1's program, started at its own count of the model's random stream
    config = sharding_test_config().replace(
        num_hidden_layers=3, layer_types=("kda", "mla", "mla"), mlp_layer_types=("dense", "moe", "moe")
    )
    mesh = make_mesh({"expert": 8})
    model = random_model(config, mesh=mesh, weights="stored", dtype=jnp.float32, seed=2, progress=True)
    assert ": 3 programs lowered in" in capsys.readouterr().err  # 2 kinds of layer and the rest
    assert_each_device_holds_its_fraction(model, mesh)
    up = model.model.layers[1].mlp.experts.up_proj.get_value()
    assert isinstance(up, BlockFP8Weight) and up.values.dtype == jnp.float8_e4m3fn
    assert {s.data.shape for s in up.values.addressable_shards} == {(4, 32, 64)}  # 32 experts over 8 devices
    assert len({s.device for s in up.values.addressable_shards}) == 8

    eager = leaves(LingForCausalLM(config, rngs=nnx.Rngs(2), dtype=jnp.float32))
    scale = np.float32(FP8_INIT_RANGE / 448)
    quantized = 0
    for name, leaf in leaves(model).items():
        if name.endswith(".scales"):
            assert np.all(np.asarray(leaf) == scale), name
        elif name.endswith(".values"):  # the eager initial weight, rounded to e4m3 with the fixed scale
            quantized += 1
            weight = eager[name.removesuffix(".values")]
            codes = np.clip(np.asarray(weight) / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
            assert np.mean(np.asarray(leaf) == codes) > 0.999, name
            assert rel_error(np.asarray(leaf, np.float32) * scale, weight) < 3e-2, name
        else:
            np.testing.assert_allclose(np.asarray(leaf), np.asarray(eager[name]), rtol=1e-6, atol=1e-7, err_msg=name)
    assert quantized > 20
