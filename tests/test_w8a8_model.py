"""The model in W8A8 (`ExecutionPolicy(fp8_matmul="w8a8")`: every block-FP8 projection and the routed experts with
their activations quantised per token in 1 x 128 groups and FP8 products) on the GPU kernels in Pallas interpret
mode, against the same FP8 checkpoint dequantised to bf16 on the reference backend, one compiled forward each.

The checkpoint is the trained demo model (`ling_jax/assets/ling-demo`, block FP8 128 x 128, spec §6.2) and the
prompts random windows of held-out text: a random-weight model has near-uniform next-token scores whose top-1 flips
under any rounding (the factory's tiny models are chaotic), a trained one has a next token to agree on. Measured on
6 x 64 tokens (CPU, 2026-12-03, the experts in W8A8 too): W8A8 logits 3.1e-2 from the bf16 model, 96.9% top-1
agreement, next-token accuracy on the text 28.0% against 27.8%; for scale, the bf16 model itself is 0.8e-2 and
98.2% from the fp32 one, and with the projections alone in W8A8 the W8A8 formula in fp32 (jnp reference) gave
3.1e-2 and 96.6%: the gap to issue 25's 3e-2 / 99% is the activation quantisation itself (e4m3 keeps 3 mantissa
bits, ~3% per product), not the kernels.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import REPO_ROOT, gpu_test, rel_error
from tiny_fp8 import write_tiny_fp8_checkpoint
from tokenizers import Tokenizer

from ling_jax import ExecutionPolicy, FP8Matmul, load_hf_checkpoint, load_model_config
from ling_jax.generation import cli as generate_cli
from ling_jax.layers import project
from ling_jax.quantized import BlockFP8Weight
from pallas_kernels.fp8 import w8a8_linear_reference, weight_only_linear_reference
from pallas_kernels.fp8.tuned import W8A8_MIN_ROWS

DEMO = REPO_ROOT / "ling_jax" / "assets" / "ling-demo"
PROMPTS, LENGTH = 6, 64
# the interpreted kernels' forward over 384 tokens: 90 s of unoptimised XLA:CPU code at the suite's cheap level, 4 s
# fully optimised (for 5 s more compiling)
pytestmark = pytest.mark.usefixtures("full_xla_optimisation")


def random_text_windows(seed: int = 0) -> np.ndarray:
    """[PROMPTS, LENGTH] token ids: windows at random offsets of the held-out Austen text, demo tokenizer."""
    ids = (
        Tokenizer.from_file(str(DEMO / "tokenizer.json"))
        .encode((REPO_ROOT / "tests/data/persuasion_heldout.txt").read_text())
        .ids
    )
    starts = np.random.default_rng(seed).integers(0, len(ids) - LENGTH, PROMPTS)
    return np.stack([ids[start : start + LENGTH] for start in starts])


def forward_and_program(model, ids_BT):
    """(logits [B, T, V] float32 numpy, the traced program's text) of one compiled forward."""
    graph, state = nnx.split(model)
    traced = jax.jit(lambda state, ids: nnx.merge(graph, state)(ids).logits).trace(state, ids_BT)
    return np.asarray(traced.lower().compile()(state, ids_BT), np.float32), str(traced.jaxpr)


def check_w8a8_against_bf16(backend: str) -> None:
    """The W8A8 model on `backend` vs the bf16-dequantised one on the reference backend (module docstring)."""
    ids = random_text_windows()
    policy = ExecutionPolicy(kernel_backend=backend, fp8_matmul=FP8Matmul.W8A8)
    w8a8 = load_hf_checkpoint(DEMO, dtype=jnp.bfloat16, policy=policy, progress=False)
    assert isinstance(w8a8.model.layers[0].attention.q_proj.weight.get_value(), BlockFP8Weight)
    logits, program = forward_and_program(w8a8, jnp.asarray(ids))
    assert "w8a8_linear" in program and "weight_only_linear" not in program
    assert "gather_swiglu_w8a8" in program and "down_scatter_w8a8" in program  # the experts' W8A8 kernels
    dense = load_hf_checkpoint(
        DEMO, dtype=jnp.bfloat16, weights="bf16", policy=ExecutionPolicy(kernel_backend="reference"), progress=False
    )
    expected, _ = forward_and_program(dense, jnp.asarray(ids))
    err = rel_error(logits, expected)
    agreement = float(np.mean(logits.argmax(-1) == expected.argmax(-1)))
    accuracy = {
        name: float(np.mean(x[:, :-1].argmax(-1) == ids[:, 1:])) for name, x in (("w8a8", logits), ("bf16", expected))
    }
    print(
        f"[w8a8 model] {backend}: logits rel. error {err:.2e}, top-1 agreement {agreement:.1%} over {ids.size} "
        f"positions, next-token accuracy {accuracy['w8a8']:.1%} (bf16 model {accuracy['bf16']:.1%})"
    )
    assert err <= 5e-2, f"logits rel. error {err:.2e}"
    assert agreement >= 0.94, f"top-1 agreement {agreement:.1%}"
    assert accuracy["w8a8"] >= accuracy["bf16"] - 0.02, accuracy


def test_w8a8_model_matches_the_dequantised_model():
    check_w8a8_against_bf16("interpret_gpu")


@gpu_test("the compiled W8A8 model")
def test_compiled_w8a8_model_matches_the_dequantised_model():
    check_w8a8_against_bf16("pallas_gpu")


def test_fp8_matmul_policy_is_checked():
    assert ExecutionPolicy(fp8_matmul="weight_only").fp8_matmul is FP8Matmul.WEIGHT_ONLY
    with pytest.raises(ValueError, match=r"fp8_matmul: 'fp8' is not one of 'auto', 'weight_only', 'w8a8'"):
        ExecutionPolicy(fp8_matmul="fp8")


def test_project_multiplies_as_the_policy_says():
    """AUTO (the default policy) on the reference backend: dequantise-then-dot; a W8A8 policy: W8A8's reference."""
    r = np.random.default_rng(4)
    weight = BlockFP8Weight(
        jnp.asarray(r.normal(size=(40, 96)) * 50, jnp.float8_e4m3fn),
        jnp.asarray(r.uniform(1e-3, 1e-2, (2, 3)), jnp.float32),
        (32, 32),
    )
    x = jnp.asarray(r.normal(size=(3, 5, 96)), jnp.float32)
    expected = {
        FP8Matmul.AUTO: weight_only_linear_reference(x.reshape(15, 96), weight.values, weight.scales, weight.block),
        FP8Matmul.WEIGHT_ONLY: weight_only_linear_reference(
            x.reshape(15, 96), weight.values, weight.scales, weight.block
        ),
        FP8Matmul.W8A8: w8a8_linear_reference(x.reshape(15, 96), weight.values, weight.scales, weight.block),
    }
    assert rel_error(expected[FP8Matmul.W8A8], expected[FP8Matmul.AUTO]) > 1e-3  # the modes differ measurably
    for mode, y in expected.items():
        policy = ExecutionPolicy(kernel_backend="reference", fp8_matmul=mode)
        np.testing.assert_array_equal(np.asarray(project(x, weight, policy)).reshape(15, 40), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(project(x, weight)), np.asarray(project(x, weight, ExecutionPolicy())))


def test_a_dynamic_checkpoint_prefills_in_w8a8_unless_weight_only(tmp_path):
    """A block-FP8 checkpoint whose quantization_config declares `activation_scheme: dynamic` (tests/support/
    tiny_fp8.py, 16 x 16 blocks), loaded with the default `fp8_matmul` (auto): a GPU backend multiplies a
    prefill-sized call (W8A8_MIN_ROWS rows) in W8A8 and a decode-sized one weight-only; `--fp8-matmul weight_only`
    gives the dequantised weights' products at every size; on a CPU ("auto" backend) auto is weight-only too."""
    config = write_tiny_fp8_checkpoint(tmp_path)
    quantization = load_model_config(tmp_path).quantization
    assert quantization.activation_scheme == "dynamic"
    weight_only_flag = generate_cli.build_parser().parse_args(["--fp8-matmul", "weight_only", "x"]).fp8_matmul
    gpu = ExecutionPolicy(kernel_backend="interpret_gpu")
    models = {
        flag: load_hf_checkpoint(tmp_path, dtype=jnp.float32, progress=False, policy=gpu.replace(fp8_matmul=flag))
        for flag in (generate_cli.build_parser().parse_args(["x"]).fp8_matmul, weight_only_flag)
    }
    default, pinned = models.values()
    weight = default.model.layers[0].attention.q_proj.weight.get_value()
    assert isinstance(weight, BlockFP8Weight)
    r = np.random.default_rng(5)
    prefill_x, decode_x = (jnp.asarray(r.normal(size=(rows, config.hidden_size)), jnp.float32) for rows in (256, 1))
    assert prefill_x.shape[0] == W8A8_MIN_ROWS
    reference = {
        mode: {len(x): op(x, weight.values, weight.scales, weight.block) for x in (prefill_x, decode_x)}
        for mode, op in ((FP8Matmul.W8A8, w8a8_linear_reference), (FP8Matmul.WEIGHT_ONLY, weight_only_linear_reference))
    }
    modes_apart = rel_error(reference[FP8Matmul.W8A8][256], reference[FP8Matmul.WEIGHT_ONLY][256])
    assert modes_apart > 1e-3

    def mode_of(x, policy) -> FP8Matmul:
        y = project(x, weight, policy)
        errors = {mode: rel_error(y, reference[mode][len(x)]) for mode in reference}
        closest = min(errors, key=errors.get)
        assert errors[closest] <= modes_apart / 100, errors
        return closest

    assert default.policy.fp8_matmul is FP8Matmul.AUTO and pinned.policy.fp8_matmul is FP8Matmul.WEIGHT_ONLY
    assert mode_of(prefill_x, default.policy) is FP8Matmul.W8A8
    assert mode_of(decode_x, default.policy) is FP8Matmul.WEIGHT_ONLY
    assert mode_of(prefill_x, pinned.policy) is FP8Matmul.WEIGHT_ONLY
    assert mode_of(prefill_x, default.policy.replace(kernel_backend="auto")) is FP8Matmul.WEIGHT_ONLY  # a CPU
    static = dataclasses.replace(quantization, activation_scheme="static")
    assert ExecutionPolicy().for_checkpoint(static).fp8_matmul is FP8Matmul.WEIGHT_ONLY
