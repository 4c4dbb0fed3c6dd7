"""Issue 25: the sharded FP8 model equals the unsharded FP8 model on the four meshes of the sharding tests. A tiny
block-FP8 checkpoint (16 x 16 blocks) is loaded with weights="stored" straight onto each mesh and its logits
compared with the one-device model's (fp32, one compile per mesh)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import rel_error
from tiny_fp8 import write_tiny_fp8_checkpoint

from ling_jax import load_hf_checkpoint, make_mesh
from ling_jax.generation.sharded import ShardedLM
from ling_jax.quantized import BlockFP8Weight

TOL_F32 = 1e-4
# tests/test_sharding.py's MESHES, and expert=8 (which it covers through its expert-parallel tests)
MESHES = [{"data": 2, "expert": 4}, {"tensor": 2, "expert": 4}, {"fsdp": 2, "tensor": 2, "expert": 2}, {"expert": 8}]


def _inputs(vocab_size: int, batch: int = 8, length: int = 13):
    ids = np.random.default_rng(1).integers(0, vocab_size, (batch, length)).astype(np.int32)
    mask = np.ones((batch, length), bool)
    mask[1, :5] = False  # left padding on two rows
    mask[6, :12] = False  # a one-token prompt
    return jnp.asarray(ids), jnp.asarray(mask)


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory):
    """(checkpoint directory, inputs, the one-device FP8 model's logits)."""
    directory = tmp_path_factory.mktemp("fp8")
    config = write_tiny_fp8_checkpoint(directory, seed=3)
    ids, mask = _inputs(config.vocab_size)
    model = load_hf_checkpoint(directory, dtype=jnp.float32, progress=False)
    assert isinstance(model.model.layers[1].mlp.experts.down_proj.get_value(), BlockFP8Weight)
    graphdef, state = nnx.split(model)
    logits = jax.jit(lambda s: nnx.merge(graphdef, s)(ids, attention_mask=mask).logits)(state)
    return directory, (ids, mask), np.asarray(logits)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: ",".join(f"{k}={n}" for k, n in s.items()))
def test_sharded_fp8_model_equals_unsharded(unsharded, shape):
    directory, (ids, mask), expected = unsharded
    mesh = make_mesh(shape)
    model = load_hf_checkpoint(directory, mesh=mesh, dtype=jnp.float32, progress=False)
    for weight in (model.model.layers[0].attention.q_proj.weight, model.model.layers[1].mlp.experts.up_proj):
        value = weight.get_value()
        assert isinstance(value, BlockFP8Weight) and value.values.dtype == jnp.float8_e4m3fn
        assert len(value.values.sharding.device_set) == 8
    err = rel_error(ShardedLM(model, mesh)(ids, attention_mask=mask), expected)
    print(f"[sharded FP8] {shape}: logits fp32 rel. error {err:.1e} vs one device")
    assert err <= TOL_F32
