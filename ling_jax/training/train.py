"""Training `LingForCausalLM`: next-token cross-entropy plus the MTP draft loss (spec §5), AdamW with a
warmup + cosine schedule and global-norm clipping, and aux-loss-free router balancing (DeepSeek-V3).

The parameters are split in two: `params`, trained by the optimizer, and every MoE router's `expert_bias`,
which no gradient touches. After each step each bias moves against its layer's load imbalance,
expert_bias_e += rate * sign(mean load - load_e), from the `expert_load` counts the MoE layers sow.

`train_step(graphdef, state, batch, config)` and `eval_step(graphdef, state, batch, config)` are pure functions of
their arguments (graphdef and config static); `jit_train_step` / `jit_eval_step` are them jitted on one
device (the state donated), and parallel training jits the same functions with shardings.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from ling_jax.model import LingForCausalLM
from ling_jax.quantized import is_quantized

EXPERT_BIAS = nnx.PathContains("expert_bias")
TRAINABLE = nnx.All(nnx.Param, nnx.Not(EXPERT_BIAS))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    learning_rate: float = 3e-3  # peak, reached after the warmup
    warmup_steps: int = 100
    total_steps: int = 1000  # the cosine decays to end_learning_rate_fraction * peak at this step
    end_learning_rate_fraction: float = 0.1
    weight_decay: float = 0.1  # on matrices only (ndim >= 2): not on norm weights, A_log or dt_bias
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    grad_clip_norm: float = 1.0
    expert_bias_rate: float = 1e-3  # DeepSeek-V3's bias update speed
    remat: bool = False  # save only weight-matmul outputs of the forward pass, recompute the rest
    mtp_loss_scale: float = 0.0  # weight of the MTP draft loss (0 = off; scripts/train.py trains the demo with 0.1)

    def __post_init__(self):
        if not self.mtp_loss_scale >= 0:
            raise ValueError(f"TrainConfig.mtp_loss_scale: must be >= 0, got {self.mtp_loss_scale}")


@struct.dataclass
class Batch:
    tokens: jax.Array  # [B, T] int32
    mask: jax.Array  # [B, T] bool, True for real tokens


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: nnx.State  # every parameter but the expert biases
    expert_bias: nnx.State  # [E] per MoE layer, fp32, updated by the balancing rule only
    opt_state: optax.OptState


def learning_rate_schedule(config: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=max(config.total_steps, config.warmup_steps + 1),
        end_value=config.learning_rate * config.end_learning_rate_fraction,
    )


def optimizer(config: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(config.grad_clip_norm),
        optax.adamw(
            learning_rate_schedule(config),
            b1=config.adam_b1,
            b2=config.adam_b2,
            weight_decay=config.weight_decay,
            mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
        ),
    )


def init_train_state(model: LingForCausalLM, config: TrainConfig) -> tuple[nnx.GraphDef, TrainState]:
    """Split `model` into its static graph and a fresh TrainState (step 0, optimizer moments at zero). Training
    keeps dense master weights: a model holding quantised weights (loaded with weights="stored") is refused."""
    graphdef, expert_bias, params = nnx.split(model, EXPERT_BIAS, TRAINABLE)
    for path, variable in nnx.to_flat_state(params):
        if is_quantized(variable.get_value()):
            raise ValueError(
                f"init_train_state: parameter '{'.'.join(map(str, path))}' is a quantised weight; training keeps "
                "dense master weights: load the checkpoint with weights='bf16' (dtype=jnp.float32 for fp32 masters)"
            )
    return graphdef, TrainState(
        step=jnp.zeros((), jnp.int32), params=params, expert_bias=expert_bias, opt_state=optimizer(config).init(params)
    )


def merge_model(graphdef: nnx.GraphDef, state: TrainState) -> LingForCausalLM:
    return nnx.merge(graphdef, state.expert_bias, state.params)


def _mean_cross_entropy(logits_BTV, targets_BT, weights_BT):
    """(mean loss over weighted positions, number of positions)."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32), targets_BT)
    count = weights_BT.sum()
    return (losses * weights_BT).sum() / jnp.maximum(count, 1.0), count


def _model_losses(model: LingForCausalLM, batch: Batch, mtp_loss_scale: float):
    """-> (loss, metrics): next-token loss over real tokens, plus mtp_loss_scale x the MTP loss."""
    tokens, real = batch.tokens, batch.mask.astype(bool)
    out = model(tokens, attention_mask=real)
    next_real = real[:, :-1] & real[:, 1:]  # position t predicts real token t+1 from a real token t
    lm_loss, lm_count = _mean_cross_entropy(out.logits[:, :-1], tokens[:, 1:], next_real.astype(jnp.float32))
    metrics = {"lm_loss": lm_loss, "tokens": lm_count}
    scale = mtp_loss_scale
    if not scale:
        return lm_loss, metrics
    # the draft at t reads hidden state t and token t+1, and predicts token t+2
    draft = model.draft_logits(out.hidden[:, :-1], tokens[:, 1:], attention_mask=next_real)
    mtp_loss, _ = _mean_cross_entropy(
        draft.logits[:, :-1], tokens[:, 2:], (next_real[:, :-1] & real[:, 2:]).astype(jnp.float32)
    )
    return lm_loss + scale * mtp_loss, {**metrics, "mtp_loss": mtp_loss}


def loss_and_expert_loads(params, expert_bias, graphdef, batch: Batch, mtp_loss_scale: float = 0.0):
    """-> (loss, (metrics, expert loads: MoE path -> [E] token-assignment counts of this batch)); the loss adds
    mtp_loss_scale x the MTP draft loss (`TrainConfig.mtp_loss_scale`; 0: no draft pass)."""
    model = nnx.merge(graphdef, expert_bias, params)
    (loss, metrics), intermediates = nnx.capture(_model_losses, nnx.Intermediate)(model, batch, mtp_loss_scale)
    loads = {
        path[:-1]: sum(variable.get_value())
        for path, variable in nnx.to_flat_state(intermediates)
        if path[-1] == "expert_load"
    }
    return loss, (metrics, loads)


def balanced_expert_bias(expert_bias: nnx.State, loads: dict[tuple, jax.Array], rate: float) -> nnx.State:
    """expert_bias_e += rate * sign(mean load - load_e) per MoE layer: overloaded experts get picked less.
    A MoE that did not run (the MTP layer when there is no MTP loss) keeps its bias."""
    updated = []
    for path, variable in nnx.to_flat_state(expert_bias):
        load_E = loads.get(path[:-2])  # (..., "mlp", "gate", "expert_bias") -> the MoE at (..., "mlp")
        if load_E is not None:
            bias = variable.get_value()
            variable = variable.replace(bias + rate * jnp.sign(load_E.mean() - load_E).astype(bias.dtype))
        updated.append((path, variable))
    return nnx.from_flat_state(updated)


def _load_imbalance(loads: dict[tuple, jax.Array]) -> jax.Array:
    """max load / mean load, averaged over MoE layers (1 = perfectly balanced)."""
    return jnp.mean(jnp.stack([load.max() / jnp.maximum(load.mean(), 1e-9) for load in loads.values()]))


def train_step(graphdef: nnx.GraphDef, state: TrainState, batch: Batch, config: TrainConfig):
    """-> (new state, metrics: dict of scalars): one AdamW step on the batch, then the expert-bias update."""
    losses = loss_and_expert_loads
    if config.remat:
        losses = jax.checkpoint(
            loss_and_expert_loads,
            static_argnums=(2, 4),
            policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        )
    grad_fn = jax.value_and_grad(losses, has_aux=True)
    (loss, (metrics, loads)), grads = grad_fn(state.params, state.expert_bias, graphdef, batch, config.mtp_loss_scale)
    updates, opt_state = optimizer(config).update(grads, state.opt_state, state.params)
    new_state = TrainState(
        step=state.step + 1,
        params=optax.apply_updates(state.params, updates),
        expert_bias=balanced_expert_bias(state.expert_bias, loads, config.expert_bias_rate),
        opt_state=opt_state,
    )
    metrics = {
        **metrics,
        "loss": loss,
        "grad_norm": optax.tree.norm(grads),
        "learning_rate": learning_rate_schedule(config)(state.step),
    }
    if loads:
        metrics["load_imbalance"] = _load_imbalance(loads)
    return new_state, metrics


def eval_step(graphdef: nnx.GraphDef, state: TrainState, batch: Batch, config: TrainConfig) -> dict[str, jax.Array]:
    """-> metrics (loss, lm_loss, mtp_loss when config.mtp_loss_scale > 0, tokens) of the batch, without
    updating anything."""
    loss, (metrics, _) = loss_and_expert_loads(state.params, state.expert_bias, graphdef, batch, config.mtp_loss_scale)
    return {**metrics, "loss": loss}


jit_train_step = jax.jit(train_step, static_argnames=("graphdef", "config"), donate_argnames=("state",))
jit_eval_step = jax.jit(eval_step, static_argnames=("graphdef", "config"))
