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


def test_device_seconds_a_call(tmp_path):
    _write_trace(tmp_path)
    assert abs(trace.device_seconds(tmp_path, 2) - 306e-6) < 1e-12  # device kernels only, the host event left out


def test_a_directory_reads_its_own_profile_not_a_newer_one_in_a_subfolder(tmp_path):
    _write_trace(tmp_path)
    _write_trace(tmp_path / "decode_group")  # written later: the newest trace below tmp_path
    with gzip.open(next((tmp_path / "decode_group").rglob("perfetto_trace.json.gz")), "wt") as f:
        json.dump({"traceEvents": []}, f)
    assert trace.find_trace(tmp_path).parent.parent.parent == tmp_path / "plugins"
    assert "decode_group" in str(trace.find_trace(tmp_path / "decode_group"))


def test_device_time_per_program_and_idle():
    kernels = [
        {"ts": 0.0, "dur": 600.0, "args": {"hlo_module": "jit__decode_group"}},
        {"ts": 500.0, "dur": 200.0, "args": {"hlo_module": "jit__prefill"}},  # overlaps the first by 100 us
        {"ts": 1700.0, "dur": 300.0, "args": {"hlo_module": "jit__decode_group"}},
        {"ts": 1900.0, "dur": 20.0},
    ]
    table = trace.module_table(kernels)
    assert table.splitlines()[0] == "span 2.0 ms: busy 1.0 ms, idle 1.0 ms (50%)"
    assert "| jit__decode_group | 2 | 0.9 | 45% |" in table and "| jit__prefill | 1 | 0.2 | 10% |" in table
    assert "| ? | 1 | 0.0 | 1% |" in table


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


GPU_HLO = """HloModule jit_step, is_scheduled=true

%fused_negate (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %negate.1 = f32[4]{0} negate(%a)
}

%fused_multiply (b: f32[4]) -> f32[4] {
  %b = f32[4]{0} parameter(0)
  %constant.2 = f32[] constant(2), metadata={op_name="jit(step)/sampling/mul"}
  %nested_fusion.1 = f32[4]{0} fusion(%b), kind=kLoop, calls=%fused_negate
  ROOT %multiply.3 = f32[4]{0} multiply(%nested_fusion.1, %b), metadata={op_name="jit(step)/decoder_layer_2/moe/mul"}
}

ENTRY %main.1 (c: f32[4]) -> f32[4] {
  %c = f32[4]{0} parameter(0), metadata={op_name="cache.layers[1].latent"}
  %loop_multiply_fusion.4 = f32[4]{0} fusion(%c), kind=kLoop, calls=%fused_multiply, \
metadata={op_name="jit(step)/decoder_layer_0/kda/mul" deduplicated_name="loop_multiply_fusion.1"}
  %pallas_call.5 = f32[4]{0} custom-call(%loop_multiply_fusion.4), custom_call_target="__gpu$xla.gpu.triton", \
metadata={op_name="jit(step)/decoder_layer_0/kda/jit(gemv)/weight_only_gemv/pallas_call"}
  %loop_multiply_fusion.2 = f32[4]{0} fusion(%pallas_call.5), kind=kLoop, calls=%fused_multiply, \
metadata={op_name="jit(step)/decoder_layer_1/mla/mul" deduplicated_name="loop_multiply_fusion.1"}
  %copy.6 = f32[4]{0} copy(%c)
  %loop_multiply_fusion.7 = f32[4]{0} fusion(%copy.6), kind=kLoop, calls=%fused_multiply, \
metadata={deduplicated_name="loop_multiply_fusion.1"}
  ROOT %pallas_call.8 = f32[4]{0} custom-call(%loop_multiply_fusion.7), custom_call_target="__gpu$xla.gpu.triton", \
metadata={op_name="jit(step)/decoder_layer_2/moe/jit(gemv)/weight_only_gemv/pallas_call"}
}
"""


def test_command_buffer_kernels_by_launch_group_and_schedule_order():
    """A GPU trace with XLA command buffers: every kernel's hlo_op is the command buffer, so each kernel is matched by
    its name and its place in the trace to an instruction of its launch group (the fusions XLA deduplicated into one
    kernel or a few named like a member, a Pallas kernel and its variants, the copies' memcpy), in schedule order."""
    launches = trace.hlo_launches(GPU_HLO)
    group = ("loop_multiply_fusion.4", "loop_multiply_fusion.2", "loop_multiply_fusion.7")
    assert launches["loop_multiply_fusion_4"] == launches["loop_multiply_fusion_2"] == group
    assert launches["weight_only_gemv"] == ("pallas_call.5", "pallas_call.8")
    assert launches[trace.MEMCPY] == ("copy.6",)
    assert "nested_fusion_1" not in launches  # inside a fusion: no kernel of its own
    scopes = trace.hlo_scopes(GPU_HLO)
    assert scopes["fused_multiply"] == "jit(step)/decoder_layer_2/moe/mul"  # not its constant's
    assert scopes["copy.6"] == "decoder_layer_1/mla"  # layer 1's cache: its mixer is MLA
    names = ["loop_multiply_fusion_4", "weight_only_gemv", "loop_multiply_fusion_2", "memcpy32_post"]
    names += ["loop_multiply_fusion_2", "weight_only_gemv__1"]
    command_buffer = {"hlo_op": "command_buffer_1", "hlo_module": "jit_step"}
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}}]
    for step in range(2):
        events += [
            {"ph": "X", "pid": 1, "ts": 10 * step + i, "dur": i + 1.0, "name": name, "args": command_buffer}
            for i, name in enumerate(names)
        ]
    kernels = trace.kernels({"traceEvents": events}, "jit_step")
    assert trace.time_by_layer_kind(kernels, scopes, launches) == {
        "KDA layer": (4, 6.0),
        "MLA layer": (4, 14.0),
        "MoE / dense FFN": (4, 22.0),
        "lm_head / sampling": (0, 0.0),
        "other": (0, 0.0),
    }


def test_idle_time_before_each_kernel():
    kernels = [
        {"ts": 0.0, "dur": 100.0, "name": "gemm.1"},
        {"ts": 130.0, "dur": 50.0, "name": "mosaic"},  # 30 us idle before it
        {"ts": 150.0, "dur": 10.0, "name": "copy"},  # overlaps: none
        {"ts": 200.0, "dur": 100.0, "name": "gemm.2"},  # 20 us
        {"ts": 340.0, "dur": 60.0, "name": "mosaic"},  # 40 us
    ]
    table = trace.idle_table(kernels, steps=2)
    assert table.splitlines()[0] == "span 200.0 us per step: idle 45.0 us (22%)"
    assert "| 35.0 | 1.0 | 35.0 | mosaic |" in table.splitlines()[4]
    assert "| 10.0 | 1.0 | 10.0 | gemm |" in table
