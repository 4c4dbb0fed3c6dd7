"""scripts/trace_summary.py on a small synthetic Perfetto trace: device kernels only, per-step figures."""

from __future__ import annotations

import gzip
import json
import pathlib
import subprocess
import sys

from helpers import REPO_ROOT

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
