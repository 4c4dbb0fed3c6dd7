"""scripts/trace_summary.py and its parser (`benchmarks.trace`) on small synthetic Perfetto traces and HLO text: device
kernels only, per-step figures, the time per layer kind."""

from __future__ import annotations

import gzip
import json
import pathlib
import subprocess
import sys

from helpers import REPO_ROOT

from benchmarks import trace

SCRIPT = REPO_ROOT / "scripts" / "trace_summary.py"


def _write_trace(directory: pathlib.Path) -> None:
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 7, "tid": 1, "ts": 0.0, "dur": 900.0, "name": "PjitFunction(step)"},
    ]
    for step in range(2):
        start = 1000.0 * step
        events += [
            {"ph": "X", "pid": 1, "tid": 2, "ts": start, "dur": 300.0, "name": "gemm_fusion_dot.3"},
            {"ph": "X", "pid": 1, "tid": 2, "ts": start + 300, "dur": 2.0, "name": "loop_add_fusion_1"},
            {"ph": "X", "pid": 1, "tid": 2, "ts": start + 302, "dur": 4.0, "name": "loop_add_fusion_2"},
        ]
    run = directory / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, check=False)


def test_per_step_device_time_and_small_kernel_tail(tmp_path):
    _write_trace(tmp_path)
    result = _run(tmp_path, "--steps", 2)
    assert result.returncode == 0, result.stderr
    assert "3 kernels and 306.0 us of device time per step (2 steps)" in result.stdout
    assert "| 300.0 | 1.0 | 300.0 | gemm_fusion_dot |" in result.stdout  # ".3" stripped, host events ignored
    assert "| 4.0 | 1.0 | 4.0 | loop_add_fusion_2 |" in result.stdout
    assert "kernels averaging under 8 us: 2 per step, 6.0 us per step" in result.stdout
    merged = _run(tmp_path, "--steps", 2, "--by-kind")
    assert "| 6.0 | 2.0 | 3.0 | loop_add_fusion |" in merged.stdout


def test_errors_name_the_path(tmp_path):
    result = _run(tmp_path / "missing")
    assert result.returncode == 1 and result.stderr.strip() == f"error: {tmp_path / 'missing'} does not exist"
    result = _run(tmp_path)
    assert result.returncode == 1 and "no perfetto_trace.json.gz below it" in result.stderr


HLO = """HloModule jit_step, is_scheduled=true

%fused_computation (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %multiply.1 = f32[4]{0} multiply(%param_0, %param_0), metadata={op_name="jit(step)/decoder_layer_1/mla/mul"}
}

ENTRY %main.9 (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0), metadata={op_name="params[\\'model\\'][\\'layers\\'][0][\\'mlp\\'][\\'up\\'].value"}
  %q = f32[4]{0} parameter(1), metadata={op_name="params[\\'model\\'][\\'layers\\'][1][\\'attention\\'][\\'q\\']"}
  %convert.7 = f32[4]{0} convert(%q)
  %copy.3 = f32[4]{0} copy(%p)
  %dot.4 = f32[4]{0} add(%copy.3, %copy.3), metadata={op_name="jit(step)/decoder_layer_0/kda/add"}
  %loop_multiply_fusion.2 = f32[4]{0} fusion(%dot.4), kind=kLoop, calls=%fused_computation
  %custom-call.5 = f32[4]{0} custom-call(%loop_multiply_fusion.2), custom_call_target="x"
  ROOT %argmax.6 = f32[4]{0} add(%custom-call.5, %p), metadata={op_name="jit(step)/sampling/argmax"}
}
"""


def test_kernels_by_layer_kind_from_the_hlo_scopes(tmp_path):
    """Each kernel's HLO op (`hlo_op`, else its kernel name as the GPU spells it) -> the op_name scope in the program's
    HLO text, inherited from a called computation or the first operand where XLA gave none -> the layer kind."""
    scopes = trace.hlo_scopes(HLO)
    assert trace.hlo_module_name(HLO) == "jit_step"
    assert scopes["loop_multiply_fusion.2"] == "jit(step)/decoder_layer_1/mla/mul"  # its computation's
    assert scopes["custom-call.5"] == scopes["loop_multiply_fusion.2"]  # its operand's
    assert trace.layer_kind(scopes["copy.3"]) == "MoE / dense FFN"  # the weight it copies
    assert scopes["convert.7"] == "decoder_layer_1/mla"  # layer 1's attention weight: its mixer is MLA
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "ts": 0, "dur": 5.0, "name": "k", "args": {"hlo_op": "dot.4", "hlo_module": "jit_step"}},
        {"ph": "X", "pid": 1, "ts": 5, "dur": 1.0, "name": "loop_multiply_fusion_2"},  # no hlo_op: by its name
        {"ph": "X", "pid": 1, "ts": 6, "dur": 2.0, "name": "custom_call_5"},
        {"ph": "X", "pid": 1, "ts": 8, "dur": 3.0, "name": "argmax_6"},
        {"ph": "X", "pid": 1, "ts": 9, "dur": 4.0, "name": "copy_3"},
        {"ph": "X", "pid": 1, "ts": 9, "dur": 9.0, "name": "y", "args": {"hlo_op": "y", "hlo_module": "jit_other"}},
    ]
    kernels = trace.kernels({"traceEvents": events}, "jit_step")
    assert len(kernels) == 5
    assert trace.time_by_layer_kind(kernels, scopes) == {
        "KDA layer": (1, 5.0),
        "MLA layer": (2, 3.0),
        "MoE / dense FFN": (1, 4.0),
        "lm_head / sampling": (1, 3.0),
        "other": (0, 0.0),
    }
    table = trace.layer_kind_table(kernels, scopes, steps=1)
    assert "5 kernels and 15.0 us of device time per step (1 steps)" in table
    assert "| MLA layer | 3.0 | 20.0% | 2.0 |" in table
    _write_trace(tmp_path)
    (tmp_path / trace.HLO_FILE).write_text(HLO)
    assert "| other | 306.0 | 100.0% | 3.0 |" in _run(tmp_path, "--steps", 2).stdout  # names outside the program
