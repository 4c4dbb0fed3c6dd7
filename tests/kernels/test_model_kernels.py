"""The model with every kernel in Pallas interpret mode (KDA chunked prefill and decode step, MLA prefill and
absorbed decode, MoE, norms) == the model on the jnp reference path: a left-padded prefill into a cache, then
decode steps, all in one compiled program per backend."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import FAST_COMPILE_OPTIONS, rel_error

from ling_jax import ExecutionPolicy, LingConfig, LingForCausalLM
from ling_jax.mla import EXPANDED
from ling_jax.policy import ABSORBED_MAX_TOKENS
from ling_jax.presets import TINY

# MLA head dims the GPU prefill kernel takes (powers of two >= 16); two layers: KDA + dense MLP, MLA + MoE
KERNEL_TINY = {
    **TINY,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "num_hidden_layers": 2,
    "expert_swiglu_limit_list": [0, 7.0],
    "share_expert_swiglu_limit_list": [0, 7.0],
}
PREFILL, STEPS = ABSORBED_MAX_TOKENS + 1, 2  # a prefill long enough for the expanded MLA path (its kernel)
KERNELS = {  # named calls in each backend's program (and none of them in the reference's)
    "interpret_gpu": {"chunk_kda_gpu", "kda_decode_step_gpu", "mla_prefill_segment", "mla_decode_gpu"},
    "interpret_tpu": {"kda_chunk_prefill", "kda_decode_step_tpu", "mla_decode_tpu"},
}
FUSED_KDA_DECODE = {"chunk_kda_gpu", "kda_decode_fused_gpu", "mla_prefill_segment", "mla_decode_gpu"}


def prefill_then_steps(graph, params, ids, mask, decode_mla_mode):
    """Logits and cache of a masked prefill of PREFILL tokens, then the logits and cache after STEPS decode steps."""
    model = nnx.merge(graph, params)
    prefill = model(ids[:, :PREFILL], cache=model.init_cache(2, PREFILL + STEPS + 1), attention_mask=mask)
    cache, steps = prefill.cache, []
    for t in range(PREFILL, PREFILL + STEPS):
        out = model(ids[:, t : t + 1], cache=cache, mla_mode=decode_mla_mode)
        steps.append(out.logits)
        cache = out.cache
    return prefill.logits, prefill.cache, jnp.concatenate(steps, axis=1), cache


@pytest.mark.parametrize(
    "backend, kda_decode", [("interpret_gpu", "separate"), ("interpret_tpu", "separate"), ("interpret_gpu", "fused")]
)
def test_model_prefill_and_decode_with_kernels_equal_reference(backend, kda_decode):
    """The kernels' decode (absorbed MLA, recurrent KDA step, or the KDA layer's fused decode step) is checked
    against the reference's expanded MLA decode; the GPU backend's prefill goes through the MLA prefill kernel.
    The kernels' presence is checked in the traced program."""
    config = LingConfig.from_dict(KERNEL_TINY)
    ids = jnp.asarray(np.random.default_rng(8).integers(2, config.vocab_size, (2, PREFILL + STEPS)))
    mask = jnp.asarray(np.r_[[[0, 0] + [1] * (PREFILL - 2)], [[1] * PREFILL]].astype(bool))  # row 0 left-padded
    results = {}
    kernels = FUSED_KDA_DECODE if kda_decode == "fused" else KERNELS[backend]
    for name, mla_mode in ((backend, None), ("reference", EXPANDED)):
        policy = ExecutionPolicy(kernel_backend=name, kda_decode=kda_decode if name == backend else "separate")
        model = LingForCausalLM(config, rngs=nnx.Rngs(3), dtype=jnp.float32, policy=policy)
        traced = jax.jit(prefill_then_steps, static_argnums=(0, 4)).trace(*nnx.split(model), ids, mask, mla_mode)
        names = set(re.findall(r"name=(\w+)", str(traced.jaxpr)))
        assert names & (kernels | KERNELS[backend]) == (kernels if name == backend else set()), name
        results[name] = traced.lower().compile(FAST_COMPILE_OPTIONS)(*nnx.split(model)[1:], ids, mask)
    for got, want in zip(jax.tree.leaves(results[backend]), jax.tree.leaves(results["reference"]), strict=True):
        assert rel_error(got, want) <= 1e-5


def test_short_calls_over_a_cache_attend_absorbed():
    """A decode step, an MTP verify or draft pass and a short chunk over a cache take the absorbed MLA form (no
    per-call expansion of every cached key); longer calls and calls without a cache the expanded one."""
    policy = ExecutionPolicy()
    assert policy.for_call(1, cached=True).mla_mode == policy.for_call(ABSORBED_MAX_TOKENS, cached=True).mla_mode
    assert policy.for_call(ABSORBED_MAX_TOKENS, cached=True).mla_mode == "absorbed"
    assert policy.for_call(ABSORBED_MAX_TOKENS + 1, cached=True).mla_mode == "expanded"
    assert policy.for_call(3, cached=False).mla_mode == "expanded"
