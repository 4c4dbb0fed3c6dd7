"""Training: loss goes down, pads are ignored, gradients match finite differences, router balancing, and
scripts/train.py end to end (train, checkpoint, resume, FP8 export that loads back), and a sharded step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import FAST_COMPILE_OPTIONS, REPO_ROOT, SUBPROCESS_XLA_FLAGS

from convert.synthetic import config_dict
from ling_jax import LingConfig, LingForCausalLM, load_hf_checkpoint
from ling_jax.config import DENSE, KDA, MLA, MOE
from ling_jax.presets import preset
from ling_jax.sharding import make_mesh, shard_model
from ling_jax.training.train import (
    Batch,
    TrainConfig,
    balanced_expert_bias,
    init_train_state,
    jit_eval_step,
    loss_and_expert_loads,
    merge_model,
    train_step,
)

ROOT = str(REPO_ROOT)
SCRIPT = os.path.join(ROOT, "scripts", "train.py")

# every layer kind at minimum size: a KDA + dense layer, an MLA (q-LoRA) + MoE layer, the MTP layer
SMALL = preset("tiny").replace(
    vocab_size=320,
    hidden_size=32,
    num_hidden_layers=2,
    layer_types=(KDA, MLA),
    mlp_layer_types=(DENSE, MOE),
    num_attention_heads=1,
    head_dim=8,
    v_head_dim=8,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    intermediate_size=32,
    num_experts=8,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=2,
    moe_intermediate_size=8,
    shared_expert_intermediate_size=8,
)
# `jit_train_step` (the script's runs below use it) compiled with XLA:CPU's faster-compiling emitters: the tests'
# programs run a few steps each
fast_train_step = jax.jit(
    train_step,
    static_argnames=("graphdef", "config"),
    donate_argnames=("state",),
    compiler_options=FAST_COMPILE_OPTIONS,
)
STEP_CONFIG = TrainConfig(learning_rate=1e-2, warmup_steps=1, total_steps=8, expert_bias_rate=0.125, mtp_loss_scale=0.3)


def random_batch(config: LingConfig, batch: int, length: int, seed: int = 0) -> Batch:
    tokens = np.random.default_rng(seed).integers(2, config.vocab_size, (batch, length))
    return Batch(tokens=jnp.asarray(tokens, jnp.int32), mask=jnp.ones((batch, length), bool))


def test_train_steps_reduce_the_loss_on_a_fixed_batch():
    graphdef, state = init_train_state(LingForCausalLM(SMALL, rngs=nnx.Rngs(0), dtype=jnp.float32), STEP_CONFIG)
    batch = random_batch(SMALL, 2, 24)
    history = []
    for _ in range(8):
        state, metrics = fast_train_step(graphdef, state, batch, STEP_CONFIG)
        history.append(jax.device_get(metrics))
    assert int(state.step) == 8
    assert history[-1]["lm_loss"] < history[0]["lm_loss"] - 1.0
    assert history[-1]["mtp_loss"] < history[0]["mtp_loss"] - 1.0
    np.testing.assert_allclose(history[0]["loss"], history[0]["lm_loss"] + 0.3 * history[0]["mtp_loss"], rtol=1e-6)
    assert history[0]["tokens"] == 2 * 23


def test_mtp_loss_scale_is_checked():
    with pytest.raises(ValueError, match="TrainConfig.mtp_loss_scale: must be >= 0, got -0.1"):
        TrainConfig(mtp_loss_scale=-0.1)


def test_train_step_updates_the_bias_by_the_rule_only():
    graphdef, state = init_train_state(LingForCausalLM(SMALL, rngs=nnx.Rngs(0), dtype=jnp.float32), STEP_CONFIG)
    assert not any("expert_bias" in path for path, _ in nnx.to_flat_state(state.params))  # no gradient, no decay
    state, _ = fast_train_step(graphdef, state, random_batch(SMALL, 2, 24), STEP_CONFIG)
    for path, variable in nnx.to_flat_state(state.expert_bias):
        steps = np.asarray(variable.get_value()) / STEP_CONFIG.expert_bias_rate  # from zero: -1, 0 or +1
        assert set(np.unique(steps)) <= {-1.0, 0.0, 1.0}, path
        assert (steps == -1).any() and (steps == 1).any(), path


def test_pads_do_not_change_the_loss():
    graphdef, state = init_train_state(LingForCausalLM(SMALL, rngs=nnx.Rngs(0), dtype=jnp.float32), STEP_CONFIG)
    batch = random_batch(SMALL, 2, 16)
    mask = np.ones((2, 16), bool)
    mask[0, :3] = False  # left padding
    mask[1, 9:12] = False  # pads in the middle
    tokens = np.asarray(batch.tokens)
    other = np.where(mask, tokens, (tokens + 7) % SMALL.vocab_size)  # different ids under the pads
    first = jax.device_get(jit_eval_step(graphdef, state, Batch(jnp.asarray(tokens), jnp.asarray(mask)), STEP_CONFIG))
    second = jax.device_get(jit_eval_step(graphdef, state, Batch(jnp.asarray(other), jnp.asarray(mask)), STEP_CONFIG))
    assert first["tokens"] == 12 + 11  # targets t+1 where t and t+1 are both real
    for key in ("lm_loss", "mtp_loss", "loss"):
        np.testing.assert_allclose(first[key], second[key], rtol=1e-6)


def test_gradients_match_central_finite_differences():
    model = LingForCausalLM(SMALL, rngs=nnx.Rngs(0), dtype=jnp.float32)
    for seed, moe in enumerate((model.model.layers[1].mlp, model.mtp.mlp)):
        # spread-out router scores, so that few small steps flip an expert choice
        moe.gate.weight.set_value(moe.gate.weight.get_value() * 5)
        moe.gate.expert_bias.set_value(0.5 * jax.random.normal(jax.random.key(seed), (SMALL.num_experts,)))
    graphdef, state = init_train_state(model, TrainConfig())
    batch = random_batch(SMALL, 1, 12)
    value_and_grad = jax.jit(
        jax.value_and_grad(
            lambda params: loss_and_expert_loads(
                params, state.expert_bias, graphdef, batch, STEP_CONFIG.mtp_loss_scale
            ),
            has_aux=True,
        ),
        compiler_options=FAST_COMPILE_OPTIONS,
    )
    (_, (_, loads)), grads = value_and_grad(state.params)
    grads = dict(nnx.to_flat_state(grads))
    params = dict(nnx.to_flat_state(state.params))

    def perturbed(path, index, delta):
        """(loss, routing unchanged?) with one parameter entry moved by delta."""
        moved = dict(params)
        moved[path] = moved[path].replace(params[path].get_value().at[index].add(delta))
        (loss, (_, new_loads)), _ = value_and_grad(nnx.from_flat_state(list(moved.items())))
        return float(loss), all(bool((new_loads[k] == loads[k]).all()) for k in loads)

    checked = [
        ("model", "layers", 0, "attention", "q_proj", "weight"),
        ("model", "layers", 0, "attention", "k_conv1d"),
        ("model", "layers", 0, "attention", "b_proj", "weight"),
        ("model", "layers", 1, "mlp", "experts", "gate_proj"),
        ("mtp", "mlp", "experts", "down_proj"),
        ("model", "layers", 1, "attention", "kv_b_proj", "weight"),
        ("mtp", "eh_proj", "weight"),
        ("model", "word_embeddings", "weight"),
    ]
    for path in checked:
        grad = np.asarray(grads[path].get_value())
        # the largest gradient entry whose +-eps steps keep every expert choice (the loss is smooth there)
        for flat_index in np.argsort(-np.abs(grad), axis=None)[:8]:
            index = np.unravel_index(flat_index, grad.shape)
            eps = min(1e-2, 2e-3 / abs(grad[index]))  # fp32: truncation error ~ eps^2, rounding ~ 1 / eps
            (up, same_up), (down, same_down) = perturbed(path, index, eps), perturbed(path, index, -eps)
            if same_up and same_down:
                break
        else:
            raise AssertionError(f"{path}: every probed step changed the routing")
        finite_difference = (up - down) / (2 * eps)
        assert abs(finite_difference - grad[index]) <= 5e-2 * abs(grad[index]) + 2e-5, (path, index)


def test_expert_bias_moves_against_the_load():
    bias = nnx.State(
        {
            "layer": {"mlp": {"gate": {"expert_bias": nnx.Param(jnp.zeros(4, jnp.float32))}}},
            "mtp": {"mlp": {"gate": {"expert_bias": nnx.Param(jnp.ones(4, jnp.float32))}}},
        }
    )
    loads = {("layer", "mlp"): jnp.array([6.0, 2.0, 4.0, 4.0])}  # mean 4; the MTP layer did not run
    updated = balanced_expert_bias(bias, loads, 0.01)
    np.testing.assert_allclose(updated["layer"]["mlp"]["gate"]["expert_bias"][...], [-0.01, 0.01, 0.0, 0.0])
    np.testing.assert_allclose(updated["mtp"]["mlp"]["gate"]["expert_bias"][...], np.ones(4))


def _corpus(path) -> None:
    """400 random 12-word sentences over 24 words."""
    rng = np.random.default_rng(0)
    words = (
        "the house was quiet and the garden lay in the warm light of the evening while she read "
        "her letter again with a smile that nobody saw"
    ).split()
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(" ".join(rng.choice(words, size=12)).capitalize() + ".\n" for _ in range(400))


def _script_command(tmp_path, out, *flags) -> list[str]:
    """scripts/train.py on a small corpus and config written into tmp_path, batches of 2 x 32 tokens, a log line
    every step, then `flags`."""
    _corpus(tmp_path / "corpus.txt")
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config_dict(SMALL), f)
    common = ["--corpus", tmp_path / "corpus.txt", "--out", out, "--config", tmp_path / "config.json"]
    common += ["--batch-size", "2", "--seq-len", "32", "--log-every", "1", "--warmup", "1", "--eval-fraction", "0.05"]
    return [str(arg) for arg in (sys.executable, SCRIPT, *common, *flags)]


# compiles dominate the script's tiny runs: unoptimised code, compiled with the faster-compiling emitters
_SCRIPT_XLA_FLAGS = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0 {SUBPROCESS_XLA_FLAGS}"


def test_script_trains_resumes_and_exports(tmp_path):
    out = tmp_path / "run"
    command = _script_command(tmp_path, out, "--steps", "3", "--eval-every", "2", "--save-every", "2")
    # compiles dominate these tiny runs: unoptimised code, and the resumed run reuses the first one's
    env = {
        **os.environ,
        "XLA_FLAGS": _SCRIPT_XLA_FLAGS,
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    first = subprocess.run([*command, "--sample-tokens", "0"], check=False, capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(os.listdir(out / "checkpoints")) == ["2", "3"]
    with open(out / "log.json") as f:
        uninterrupted = json.load(f)

    shutil.rmtree(out / "checkpoints" / "3")  # as if the run had died after its step-2 checkpoint
    second = subprocess.run(
        [*command, "--sample-tokens", "1", "--resume"], check=False, capture_output=True, text=True, env=env
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 2" in second.stdout and "sample" in second.stdout
    with open(out / "log.json") as f:
        log = json.load(f)
    assert [entry["step"] for entry in log] == [entry["step"] for entry in uninterrupted] == [1, 2, 2, 3, 3]
    for resumed, original in zip(log, uninterrupted):  # same batches from the restored state: the same losses
        assert resumed.keys() == original.keys()
        np.testing.assert_allclose(
            [resumed[k] for k in sorted(resumed)], [original[k] for k in sorted(original)], rtol=1e-5
        )
    assert os.path.getsize(out / "loss_curve.png") > 0

    exported = set(os.listdir(out / "hf"))
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"} <= exported
    with open(out / "hf" / "config.json") as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "fp8"
    model = load_hf_checkpoint(out / "hf", dtype=jnp.float32, progress=False)
    assert model.config.vocab_size == 320 and model.config.eos_token_ids == (1,)


def test_script_stops_when_training_diverges(tmp_path):
    """A learning rate of 1e30 overflows the weights: the run stops at the first non-finite loss or
    gradient norm, says so on one line and keeps the log, instead of training on NaNs."""
    out = tmp_path / "run"
    env = {**os.environ, "XLA_FLAGS": _SCRIPT_XLA_FLAGS}
    result = subprocess.run(
        _script_command(tmp_path, out, "--steps", "20", "--lr", "1e30", "--sample-tokens", "0"),
        check=False,
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 1
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error: step ") and "training diverged" in message and "Traceback" not in result.stderr
    with open(out / "log.json") as f:
        log = json.load(f)
    assert not np.isfinite(log[-1]["loss"] + log[-1]["grad_norm"]) and log[-1]["step"] < 20


def test_sharded_train_step_equals_unsharded():
    # the first tests' batch: the unsharded step is their compiled program
    batch = random_batch(SMALL, 2, 24)

    def one_step(mesh):
        model = LingForCausalLM(SMALL, rngs=nnx.Rngs(0), dtype=jnp.float32)
        if mesh is None:
            graphdef, state = init_train_state(model, STEP_CONFIG)
            return jax.device_get(fast_train_step(graphdef, state, batch, STEP_CONFIG))
        shard_model(model, mesh)
        graphdef, state = init_train_state(model, STEP_CONFIG)
        with jax.set_mesh(mesh):
            new_state, metrics = fast_train_step(graphdef, state, batch, STEP_CONFIG)
        experts = merge_model(graphdef, new_state).model.layers[1].mlp.experts.gate_proj[...]
        assert experts.addressable_shards[0].data.shape[0] == SMALL.num_experts // 4  # still expert-parallel
        return jax.device_get((new_state, metrics))

    (ref_state, ref_metrics), (state, metrics) = one_step(None), one_step(make_mesh({"data": 2, "expert": 4}))
    assert abs(float(metrics["loss"]) - float(ref_metrics["loss"])) <= 1e-5 * abs(float(ref_metrics["loss"]))
    for ours, ref in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
        assert np.linalg.norm(ours - ref) <= 1e-5 * max(np.linalg.norm(ref), 1e-6)
    for ours, ref in zip(jax.tree.leaves(state.expert_bias), jax.tree.leaves(ref_state.expert_bias)):
        np.testing.assert_allclose(ours, ref, atol=1e-6)
