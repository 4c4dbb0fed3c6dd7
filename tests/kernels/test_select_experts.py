"""Expert selection of the group-limited router (`pallas_kernels.moe.select_experts`): the GPU kernel
(Pallas interpret mode on the CPU, compiled on the device machine) and the jnp reference against a float64
numpy router with stable sorts, ties included; gradients; lowering for CUDA from the CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import lower_for_cuda, rel_error

from pallas_kernels.moe import RoutingRule, select_experts

BACKENDS = ["interpret_gpu", "reference"]


def numpy_select(logits, bias, rule: RoutingRule):
    """Spec §4 in float64 with stable sorts: (weights [T, k], experts [T, k]) in pick order."""
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    choice = scores + bias.astype(np.float64)
    tokens, num_experts = choice.shape
    if rule.n_group:
        grouped = choice.reshape(tokens, rule.n_group, -1)
        group_score = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
        kept_groups = np.argsort(-group_score, axis=-1, kind="stable")[:, : rule.topk_group]
        kept = np.zeros(group_score.shape, bool)
        np.put_along_axis(kept, kept_groups, True, axis=-1)
        choice = np.where(np.repeat(kept, num_experts // rule.n_group, axis=-1), choice, -np.inf)
    experts = np.argsort(-choice, axis=-1, kind="stable")[:, : rule.top_k]
    weights = np.take_along_axis(scores, experts, axis=-1)
    if rule.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * rule.scaling, experts


def random_logits(tokens, num_experts, seed, ties):
    """Router logits and expert bias; with `ties`, few distinct values (equal group scores, repeated maxima)."""
    r = np.random.default_rng(seed)
    if ties:
        return (
            r.integers(-2, 3, (tokens, num_experts)).astype(np.float32),
            r.integers(0, 2, num_experts).astype(np.float32) * 0.5,
        )
    return r.normal(size=(tokens, num_experts)).astype(np.float32), r.normal(size=num_experts).astype(np.float32) * 0.1


RULES = {
    "ling-3.1": RoutingRule(top_k=8, n_group=8, topk_group=4, norm_topk_prob=True, scaling=2.5),
    "tiny-groups": RoutingRule(top_k=4, n_group=4, topk_group=2, norm_topk_prob=True, scaling=1.0),
    "odd-sizes": RoutingRule(top_k=3, n_group=3, topk_group=1, norm_topk_prob=False, scaling=1.5),
    "no-groups": RoutingRule(top_k=6, n_group=None, topk_group=None, norm_topk_prob=True, scaling=2.0),
}
EXPERTS = {"ling-3.1": 512, "tiny-groups": 16, "odd-sizes": 12, "no-groups": 40}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize("name", list(RULES))
def test_matches_numpy_router(name, tokens, ties, backend):
    rule = RULES[name]
    logits, bias = random_logits(tokens, EXPERTS[name], seed=tokens + len(name), ties=ties)
    weights, experts = select_experts(jnp.asarray(logits), jnp.asarray(bias), rule, backend=backend)
    ref_weights, ref_experts = numpy_select(logits, bias, rule)
    assert experts.dtype == jnp.int32 and weights.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(experts), ref_experts)
    assert rel_error(weights, ref_weights) <= 1e-6


def test_kernel_equals_reference_on_a_large_batch():
    """Many tokens (several programs, a partial last block), Ling-3.1-flash rule: identical picks."""
    rule = RULES["ling-3.1"]
    logits, bias = random_logits(300, 512, seed=3, ties=False)
    ours = select_experts(jnp.asarray(logits), jnp.asarray(bias), rule, backend="interpret_gpu")
    ref = select_experts(jnp.asarray(logits), jnp.asarray(bias), rule, backend="reference")
    np.testing.assert_array_equal(np.asarray(ours[1]), np.asarray(ref[1]))
    assert rel_error(ours[0], ref[0]) <= 1e-6


def test_gradient_through_the_weights():
    rule = RULES["tiny-groups"]
    logits, bias = random_logits(7, 16, seed=11, ties=False)
    probe = np.random.default_rng(2).normal(size=(7, rule.top_k)).astype(np.float32)

    def loss(backend, logits_TE, bias_E):
        weights, _ = select_experts(logits_TE, bias_E, rule, backend=backend)
        return jnp.sum(weights * probe)

    grads = {
        b: jax.jit(jax.grad(functools.partial(loss, b), argnums=(0, 1)))(jnp.asarray(logits), jnp.asarray(bias))
        for b in BACKENDS
    }
    assert rel_error(grads["interpret_gpu"][0], grads["reference"][0]) <= 1e-6
    assert np.abs(np.asarray(grads["reference"][0])).max() > 1e-3
    np.testing.assert_array_equal(np.asarray(grads["interpret_gpu"][1]), np.asarray(grads["reference"][1]))


def test_gpu_kernel_lowers_for_cuda():
    """Ling-3.1-flash: 512 experts in 8 groups, one decode token and a 4096-token prefill chunk."""
    for tokens in (1, 4096):
        args = (jax.ShapeDtypeStruct((tokens, 512), jnp.float32), jax.ShapeDtypeStruct((512,), jnp.float32))
        lowered = lower_for_cuda(functools.partial(select_experts, rule=RULES["ling-3.1"], backend="pallas_gpu"), *args)
        assert "select_experts" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="the compiled Triton kernel needs a GPU; it runs on the device machine (pytest -m gpu)",
)
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("tokens", [1, 64, 8192])
def test_compiled_gpu_kernel(tokens, ties):
    rule = RULES["ling-3.1"]
    logits, bias = random_logits(tokens, 512, seed=tokens, ties=ties)
    weights, experts = select_experts(jnp.asarray(logits), jnp.asarray(bias), rule, backend="pallas_gpu")
    ref_weights, ref_experts = numpy_select(logits, bias, rule)
    np.testing.assert_array_equal(np.asarray(experts), ref_experts)
    assert rel_error(weights, ref_weights) <= 1e-6
