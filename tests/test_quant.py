"""Quantised weights on the device (`ling_jax.quantized`): the weight-only reference path equals the dense
layers on the dequantised weights, a quantised parameter shards its values and scales alike, a mesh that would
cut a scale block is refused, and an FP8 model dtype is refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from checkpoint_factory import quantize_fp8_block, quantize_mxfp4
from flax import nnx
from helpers import rel_error

from ling_jax.layers import Linear, linear
from ling_jax.moe.experts import SharedExpert, local_moe
from ling_jax.policy import ExecutionPolicy
from ling_jax.quant import dequantize_fp8_block, dequantize_mxfp4
from ling_jax.quantized import BlockFP8Weight, MXFP4Weight, check_activation_dtype, dequantized
from ling_jax.sharding import ShardingError, make_mesh, param_specs
from pallas_kernels.moe.ops import ExpertWeights, Routing

TOL_F32 = 1e-4
RNG = np.random.default_rng(0)


def fp8_weight(shape, block) -> tuple[BlockFP8Weight, np.ndarray]:
    """(a block-FP8 weight [..., O, In] of random values, its float32 dequantisation); leading dims stacked."""
    parts = [quantize_fp8_block(RNG.normal(size=shape[-2:]), block) for _ in range(int(np.prod(shape[:-2])))]
    values = np.stack([v for v, _ in parts]).reshape(shape)
    scales = np.stack([s for _, s in parts]).reshape(*shape[:-2], *parts[0][1].shape)
    dense = np.stack([dequantize_fp8_block(v, s, block) for v, s in parts]).reshape(shape)
    return BlockFP8Weight(jnp.asarray(values), jnp.asarray(scales), block), dense


def mxfp4_weight(shape) -> tuple[MXFP4Weight, np.ndarray]:
    parts = [quantize_mxfp4(RNG.normal(size=shape[-2:]), "e8m0") for _ in range(int(np.prod(shape[:-2])))]
    packed = np.stack([p for p, _ in parts]).reshape(*shape[:-1], shape[-1] // 2)
    scales = np.stack([s for _, s in parts]).reshape(*shape[:-2], *parts[0][1].shape)
    dense = np.stack([dequantize_mxfp4(p, s) for p, s in parts]).reshape(shape)
    return MXFP4Weight(jnp.asarray(packed), jnp.asarray(scales)), dense


def test_dequantisation_matches_numpy():
    fp8, fp8_dense = fp8_weight((2, 40, 72), (16, 32))  # partial edge blocks both ways
    mxfp4, mxfp4_dense = mxfp4_weight((2, 24, 80))  # 80 inputs: a partial last 32-group
    assert fp8.scales.shape == (2, 3, 3) and mxfp4.scales.dtype == ml_dtypes.float8_e8m0fnu
    assert fp8.shape == (2, 40, 72) and mxfp4.shape == (2, 24, 80)
    np.testing.assert_array_equal(np.asarray(dequantized(fp8, jnp.float32)), fp8_dense)
    np.testing.assert_array_equal(np.asarray(jax.jit(dequantized, static_argnums=1)(mxfp4, jnp.float32)), mxfp4_dense)
    assert fp8.nbytes == 2 * 40 * 72 + 2 * 9 * 4 and mxfp4.nbytes == 2 * 24 * 40 + 2 * 24 * 3


@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_weight_only_linear_and_experts_match_dense(kind):
    """The weight-only path (dequantised inside the jitted step) against the same weights dequantised up front."""
    experts, hidden, width, tokens, top_k = 4, 64, 32, 24, 2
    make = (lambda shape: fp8_weight(shape, (16, 16))) if kind == "fp8" else mxfp4_weight
    proj, proj_dense = make((48, hidden))
    stacked = [make((experts, width, hidden)), make((experts, width, hidden)), make((experts, hidden, width))]
    shared = [make((width, hidden)), make((width, hidden)), make((hidden, width))]
    x_TD = jnp.asarray(RNG.normal(size=(tokens, hidden)), jnp.float32)
    experts_TK = jnp.asarray(RNG.permuted(np.tile(np.arange(experts), (tokens, 1)), axis=1)[:, :top_k], jnp.int32)
    weights_TK = jnp.asarray(RNG.uniform(0.1, 1.0, (tokens, top_k)), jnp.float32)

    @jax.jit
    def run(proj, stacked, shared):
        y = linear({"weight": proj}, x_TD)
        moe = local_moe(
            x_TD,
            Routing(weights_TK, experts_TK),
            ExpertWeights(*stacked),
            7.0,
            policy=ExecutionPolicy(kernel_backend="reference"),
            shared=SharedExpert(*shared, 7.0),
        )
        return y, moe

    quantized = run(proj, [w for w, _ in stacked], [w for w, _ in shared])
    dense = run(jnp.asarray(proj_dense), [jnp.asarray(d) for _, d in stacked], [jnp.asarray(d) for _, d in shared])
    for label, got, want in zip(("linear", "routed + shared experts"), quantized, dense):
        err = rel_error(got, want)
        print(f"[quantized] {kind} {label}: fp32 rel err {err:.2e}")
        assert err <= TOL_F32, f"{kind} {label}: {err:.2e}"


class Projection(nnx.Module):
    def __init__(self, weight: BlockFP8Weight):
        self.proj = Linear(64, 64, axes=("mlp", "embed"), dtype=jnp.float32, rngs=nnx.Rngs(0))
        self.proj.weight = self.proj.weight.replace(weight)


def test_values_and_scales_shard_alike_and_a_cut_block_is_refused():
    state = nnx.state(Projection(fp8_weight((64, 64), (16, 16))[0]))
    specs = param_specs(state, {"tensor": 4, "fsdp": 2})
    spec = specs["proj"]["weight"].get_value()
    assert spec.values == spec.scales == jax.sharding.PartitionSpec("tensor", "fsdp")
    with pytest.raises(ShardingError, match=r"proj\.weight: mesh axes \('tensor',\) split dimension 0 .*16-element"):
        param_specs(state, {"tensor": 8})  # 8 rows per device: half a 16-row block
    mesh = make_mesh({"tensor": 4, "fsdp": 2})
    with pytest.raises(ShardingError, match=r"proj\.weight: mesh axes \('tensor',\)"):
        param_specs(nnx.state(Projection(fp8_weight((64, 64), (128, 128))[0])), mesh.shape)


def test_an_fp8_model_dtype_is_refused():
    assert check_activation_dtype(jnp.bfloat16, "here") == jnp.bfloat16
    with pytest.raises(ValueError, match=r"here: dtype=float8_e4m3fn is not a model dtype .* weights='stored'"):
        check_activation_dtype(jnp.float8_e4m3fn, "here")
