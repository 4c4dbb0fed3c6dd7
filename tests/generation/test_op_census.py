"""benchmarks.op_census: the HLO census itself on a toy program, and what one MTP round launches against one plain
decode step on the demo checkpoint's shape (compiled on the CPU)."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks.op_census import SYNCS, demo_config, gpu_path_census, hlo_op_census, launches, main, op_census
from ling_jax.config import MOE


def test_census_counts_loop_trips_and_the_smallest_branch():
    def program(x_NN, flag):
        with jax.named_scope("lm_head"):
            y_NN = jnp.sin(x_NN) @ x_NN
        picked_N = jax.lax.cond(flag, lambda: y_NN.sum(0), lambda: jnp.sort(jnp.cos(y_NN) @ y_NN, axis=0)[0])
        return jax.lax.fori_loop(0, 3, lambda _, c_N: jnp.tanh(c_N @ x_NN) * 2, picked_N)

    x_NN = jnp.ones((4, 4))
    counts = hlo_op_census(jax.jit(program).lower(x_NN, True).compile().as_text())
    once = hlo_op_census(jax.jit(lambda c_N, x_NN: jnp.tanh(c_N @ x_NN) * 2).lower(x_NN[0], x_NN).compile().as_text())
    assert counts["lm_head"] >= 1
    assert counts[SYNCS] == 1 + 3  # the conditional, the loop's three trips
    assert launches(counts) >= counts["lm_head"] + 3 * launches(once)


def test_one_mtp_round_launches_at_most_1_35_plain_steps():
    """A --mtp 1 round (verify two tokens, sample, commit, one MTP layer) against one plain decode step: the bound
    is what the round costs today (1.29 plain steps, the verify pass's KDA recurrence unrolled: no loop trips) and a
    margin: a change that adds a layer's worth of launches to the round fails here."""
    config = demo_config()
    step, round_ = op_census(config), op_census(config, mtp=1)
    assert round_["mtp"] > 0 and step["mtp"] == 0
    assert launches(round_) <= 1.35 * launches(step), (launches(round_), launches(step))


def test_the_gpu_path_of_a_round_runs_each_moe_kernel_once_a_layer_and_once_for_the_mtp_layer():
    config = demo_config()
    step, round_ = gpu_path_census(config), gpu_path_census(config, mtp=1)
    moe_layers = config.mlp_layer_types.count(MOE)
    assert step["select_experts"] == moe_layers and round_["select_experts"] == moe_layers + 1
    assert round_["kda_verify_fused"] == step["kda_decode_fused"] > 0  # the verify pass: one kernel a KDA layer


def test_bad_draft_count_is_one_line_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        main(["--mtp", "0"])
    assert "--mtp must be >= 1, got 0" in capsys.readouterr().err
