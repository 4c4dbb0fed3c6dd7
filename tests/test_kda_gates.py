"""The KDA prefill for every gate setting: which kernel each config's gate runs (the bounded kernels only with
the safe gate's bound at -5 or above), and the layer under the interpreted any-gate kernels against the float64
layer of np_reference (spec §2) with gates far below -5."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import rel_error
from np_reference import kda_attention as kda_attention_float64

from ling_jax import functional as F
from ling_jax.kda import KimiDeltaAttention, gate_lower_bound
from ling_jax.layers import params_of
from ling_jax.presets import preset
from pallas_kernels.kda.ops import chunk_variant

PREFILL = {  # backend -> (its bounded prefill kernel, its any-gate one)
    "pallas_gpu": ("gpu_triton_short", "gpu_triton_any_gate"),
    "interpret_gpu": ("gpu_triton_short", "gpu_triton_any_gate"),
    "pallas_tpu": ("tpu_mosaic", "tpu_mosaic_any_gate"),
    "reference": ("reference", "reference"),
}
GATE_SETTINGS = {  # name -> (kda_safe_gate, kda_lower_bound, whether the bounded kernels may run)
    "safe-5": (True, -5.0, True),
    "safe-3": (True, -3.0, True),
    "safe-5.5": (True, -5.5, False),
    "safe-20": (True, -20.0, False),
    "softplus": (False, -5.0, False),  # without the safe gate the bound is not applied: -A softplus(a) has none
}


def gate_config(setting: str):
    safe, bound, _ = GATE_SETTINGS[setting]
    return dataclasses.replace(preset("tiny"), kda_safe_gate=safe, kda_lower_bound=bound)


@pytest.mark.parametrize("setting", sorted(GATE_SETTINGS))
def test_each_gate_setting_picks_its_prefill_kernel(setting):
    bounded = GATE_SETTINGS[setting][2]
    for backend, kernels in PREFILL.items():
        expected = kernels[0] if bounded else kernels[1]
        assert chunk_variant(backend, gate_lower_bound(gate_config(setting))) == expected, backend


def test_a_bounded_kernel_named_for_unbounded_gates_is_refused():
    with pytest.raises(ValueError, match="takes log-decays >= -5.0, but .* -20.0: use 'gpu_triton_any_gate'"):
        chunk_variant("interpret_gpu", -20.0, variant="gpu_triton")
    assert chunk_variant("interpret_tpu", None, variant="tpu_mosaic") == "tpu_mosaic"  # no bound given: the caller's


def float64_weights(weights, prefix: str) -> dict:
    """The layer's weights under their checkpoint names (spec §6.1), as np_reference takes them."""
    names = {}
    for name, value in weights.items():
        if isinstance(value, dict):
            names.update({f"{name}.{leaf}": x for leaf, x in value.items()})
        else:
            names[f"{name}.weight" if name.endswith("_conv1d") else name] = value
    return {f"{prefix}.{name}": np.asarray(x, np.float64) for name, x in names.items()}


@pytest.mark.parametrize("backend", ["interpret_gpu", "interpret_tpu"])
@pytest.mark.parametrize("setting", ["softplus", "safe-20"])
def test_layer_prefill_with_gates_below_the_bound(backend, setting):
    """B=2, T=75 (a multiple of neither kernel's chunk), H=4, d=16; dt_bias raised by 4 so that a third of the
    gates fall below -5 (to -28 with softplus, -20 with the safe gate) and a third stay above -1 (the bounded
    kernels fail here)."""
    config = gate_config(setting)
    layer = KimiDeltaAttention(config, dtype=jnp.float32, rngs=nnx.Rngs(3))
    weights = {**params_of(layer), "dt_bias": params_of(layer)["dt_bias"] + 4.0}
    x_BTD = np.random.default_rng(4).normal(size=(2, 75, config.hidden_size)).astype(np.float32)
    ctx = F.token_context(config, 2, 75, policy=F.ExecutionPolicy(kernel_backend=backend))
    y, _ = F.kda_attention(weights, jnp.asarray(x_BTD), None, ctx, cfg=config)
    reference_config = {
        "num_attention_heads": config.num_attention_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "kda_safe_gate": config.kda_safe_gate,
        "kda_lower_bound": config.kda_lower_bound,
    }
    expected = kda_attention_float64(float64_weights(weights, "attention"), reference_config, "attention", x_BTD)
    assert np.isfinite(np.asarray(y)).all()
    assert rel_error(y, expected) <= 1e-4, rel_error(y, expected)
