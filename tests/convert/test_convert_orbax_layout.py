"""A ling-convert directory is a plain orbax-checkpoint PyTree checkpoint: `ocp.StandardCheckpointer` restores
every stored array without a target, and they are what `load_checkpoint` restores. convert/store.py writes the
tensorstore specs itself, so this pins them to what the installed orbax reads."""

from __future__ import annotations

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from convert.cli import main
from convert.synthetic import write_random_checkpoint
from ling_jax.checkpoints.orbax import load_checkpoint, param_name, scale_name
from ling_jax.presets import preset
from ling_jax.quantized import is_quantized


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf")
    write_random_checkpoint(str(directory), preset("tiny"), num_shards=2)
    return directory


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_plain_orbax_restores_what_the_loader_restores(source, tmp_path, dtype):
    converted = tmp_path / "orbax"
    assert main([str(source), str(converted), "--dtype", dtype, "--quiet"]) == 0
    with ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.restore(converted)
    plain = {".".join(key.key for key in keys): value for keys, value in jax.tree_util.tree_flatten_with_path(tree)[0]}
    for path, variable in nnx.to_flat_state(nnx.state(load_checkpoint(converted))):
        name, loaded = param_name(path), variable.get_value()
        if is_quantized(loaded):  # FP8 kept as stored: values and block scales
            stored = {name: loaded.values, scale_name(name): loaded.scales}
        else:
            stored = {name: loaded}
        for stored_name, ours in stored.items():
            theirs = plain.pop(stored_name)
            assert ours.dtype == theirs.dtype, stored_name
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs), err_msg=stored_name)
    assert not plain, f"stored but not loaded: {sorted(plain)}"
