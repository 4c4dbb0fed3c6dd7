"""The Pallas kernels of one full-size decode step, counted from its jaxpr (`benchmarks.kernel_census`: abstract
weights, nothing allocated): a change in these counts is a change in the GPU step's launches
(docs/benchmarks/generation.md, 'Kernels in the decode step'); and the step lowered for CUDA."""

from __future__ import annotations

import collections
import dataclasses
import re

from helpers import lower_for_cuda

from benchmarks.common import flash_slice_config
from benchmarks.kernel_census import XLA_NORMS, decode_step, decode_step_census, main
from ling_jax import preset


def test_slice_decode_step_kernels_per_layer():
    """The 8-layer Ling-3.1-flash slice (7 KDA + 1 MLA, block FP8 as stored) at batch 1. A KDA layer's five FP8
    input projections run in one grouped gemv with no K split (1,280 output strips fill the GPU), MLA's q_a and
    kv_a in one with a single reduction of its K splits; each output projection is a split-K gemv whose partial
    sums the residual add + norm after it adds (no reduce of its own); MLA's q_b_proj a split-K gemv and its reduce,
    its decode's sequence splits merged by a kernel; per layer also the three MoE kernels and the input norm, with
    the previous layer's residual add in front, the MoE down kernel's split sums added there (`SplitSum`:
    `add_partials_rms_norm`; the last layer's add goes with the final norm). A KDA
    layer's gated output norm (its decode splits the values at batch 1, so cannot normalise a head's row) runs in its
    output projection's gemv, as the gemv reads o (weight_only_gemv_gated_norm). The norms left to XLA: MLA's q_a
    and kv_a norms."""
    layers, kda_layers, mla_layers = 8, 7, 1
    assert decode_step_census(flash_slice_config(layers, False), batch=1) == {
        "weight_only_gemv_many": kda_layers + mla_layers,
        "weight_only_gemv_many -> reduce": mla_layers,
        "weight_only_gemv": 2 * mla_layers,  # MLA's output projection and q_b_proj
        "weight_only_gemv -> reduce": mla_layers,  # q_b_proj's
        "weight_only_gemv_gated_norm": kda_layers,  # KDA's output projection, its gated output norm in front
        "kda_decode_fused": kda_layers,  # a KDA layer's convs, gates, recurrence between its gemvs
        "mla_absorb_query": mla_layers,
        "mla_decode_split": mla_layers,
        "mla_combine_splits": mla_layers,
        "mla_expand_output": mla_layers,
        "rms_norm": 1,  # the first layer's input norm: no residual add in front
        # after each output projection, and the previous MoE's split sums with the input norm (the last: final norm)
        "add_partials_rms_norm": 2 * layers,
        XLA_NORMS: 2 * mla_layers,
        "select_experts": layers,
        "expert_swiglu_rows": layers,
        "expert_down_combine": layers,
    }


def test_census_command_prints_the_counts(capsys):
    assert main(["--preset", "tiny", "--batch", "2"]) == 0
    printed = capsys.readouterr().out
    assert "4 layers (2 KDA + 2 MLA), batch 2: 40 pallas_calls" in printed
    assert "4 norms left to XLA (1.0 a layer)" in printed  # each MLA layer's q_a and kv_a norms
    assert "| add_rms_norm | 1 |" in printed  # after the dense first layer; the MoE layers' split sums: partials
    # each layer's input projections and the dense MLP's gate + up (two rows: still grouped)
    assert "| weight_only_gemv_many | 5 |" in printed
    assert "| add_partials_rms_norm | 7 |" in printed


def test_decode_step_lowers_for_cuda():
    """The tiny model's decode step with the GPU kernels lowers for CUDA (traced without a mesh: under one the
    norms run the reference), each residual add with the norm after it as one Triton kernel (after an MoE layer its
    down kernel's split sums added there); with KDA heads of 128
    (the fused step splits their values), each KDA layer's gated output norm in its output projection's gemv."""
    config = dataclasses.replace(preset("tiny"), head_dim=128)
    text = lower_for_cuda(decode_step(config, backend="pallas_gpu")).as_text()
    calls = collections.Counter(re.findall(r"call @((?:add_|add_partials_)?rms_norm)_gpu(?:_\d+)?\(", text))
    assert calls == {"rms_norm": 1, "add_rms_norm": 1, "add_partials_rms_norm": 7}
    assert 'name = "add_rms_norm"' in text  # the Triton kernel's
    assert 'name = "weight_only_gemv_gated_norm"' in text
