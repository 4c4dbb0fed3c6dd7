"""Kernels on a mesh: every Pallas kernel call of a layer (KDA chunked prefill and decode step, or its fused decode
step; MLA absorb / decode / expand / prefill, the router) runs per device on its own shards
(`ling_jax.sharding.per_shard`), so XLA never all-gathers a kernel's operands. Read from the compiled HLO of a
sharded prefill and decode step with the GPU kernels in interpret mode on 8 CPU devices (conftest sets the XLA
flag): no all-gather comes from inside a kernel. The values are checked elsewhere: the same shard_map runs with the
reference kernels in tests/test_sharding.py (sharded == unsharded on every mesh)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from tiny_fp8 import sharding_test_config

from ling_jax import ExecutionPolicy, LingForCausalLM
from ling_jax.generation.sharded import ShardedLM
from ling_jax.sharding import make_mesh

BATCH, CACHE = 8, 48
_GATHER = re.compile(r"^\s*%?all-gather[.\d]* = .*$", re.M)
_KERNEL_SCOPE = re.compile(r"jit\((\w+_gpu)\)")  # the GPU kernels' entry points are jitted functions named *_gpu


@functools.cache
def sharded(kda_decode: str = "separate") -> ShardedLM:
    config = sharding_test_config()
    policy = ExecutionPolicy(kernel_backend="interpret_gpu", kda_decode=kda_decode)
    model = LingForCausalLM(config, rngs=nnx.Rngs(0), dtype=jnp.float32, policy=policy)
    return ShardedLM(model, make_mesh({"data": 2, "tensor": 2, "expert": 2}))


def _compiled_step(lm: ShardedLM, length: int) -> str:
    abstract = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    cache = jax.eval_shape(lambda: lm.init_cache(BATCH, CACHE))
    tokens = jax.ShapeDtypeStruct((BATCH, length), jnp.int32)
    with lm._context():
        step = lm._step(BATCH, length, cache)
        return (
            step.lower(lm.params, jax.tree.map(abstract, cache), tokens, tokens.update(dtype=bool)).compile().as_text()
        )


@pytest.mark.parametrize(
    "length, kda_decode",
    [(1, "separate"), (16, "separate"), (1, "fused")],
    ids=["decode", "prefill", "fused_kda_decode"],
)
def test_no_kernel_operand_is_all_gathered(length, kda_decode):
    text = _compiled_step(sharded(kda_decode), length)
    assert [m[1] for line in _GATHER.findall(text) for m in _KERNEL_SCOPE.finditer(line)] == []
    assert ("jit(kda_decode_fused_gpu)" in text) == (kda_decode == "fused")
