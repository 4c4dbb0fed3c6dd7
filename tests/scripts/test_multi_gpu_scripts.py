"""benchmarks/moe/expert_parallel.py (run as python -m benchmarks.moe --devices N) in its --quick mode on the 8
virtual CPU devices (conftest sets the XLA flag): it succeeds, its chained stages equal moe_parallel;
scripts/routing_sensitivity.py on a small model. scripts/check_multi_gpu.py: test_check_multi_gpu.py."""

from __future__ import annotations

import sys

import pytest
from helpers import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))

import routing_sensitivity  # noqa: E402

from benchmarks import moe as bench_moe  # noqa: E402
from benchmarks.moe import expert_parallel as bench_expert_parallel  # noqa: E402


def test_routing_sensitivity_reports_each_fraction(capsys):
    assert routing_sensitivity.main(["--hidden", "256", "--experts", "16"]) == 0
    out = capsys.readouterr().out
    errors = [float(part.split(": ")[1]) for part in out.strip().split("off: ")[1].split(", ")]
    assert len(errors) == 3 and errors[-1] > 0


# XLA's full optimiser from here to the end of the module (a module fixture): the bench's decode steps and stages
# run several times each (35 CPU-s against 41 at the cheap level); the routing test above compiles more than it
# runs (10 CPU-s cheap, 13 optimised), so it comes first.
@pytest.mark.usefixtures("full_xla_optimisation")
def test_bench_expert_parallel_quick(capsys):
    assert bench_expert_parallel.main(["--quick", "--devices", "8", "--slices-per-expert", "16"]) == 0
    out = capsys.readouterr().out
    assert "chained stages vs moe_parallel rel. error 0.0e+00" in out
    for stage in (
        "dispatch all-to-all alone",
        "grouped GEMM",
        "combine all-to-all alone",
        "whole MoE layer",
        "ragged: dispatch",
        "ragged, 16 slices per expert: combine",
        "ragged: routed experts",
    ):
        assert stage in out
    assert "ragged exchange: chained stages vs moe_parallel rel. error 0.0e+00, vs the dense exchange 0.0e+00" in out
    assert "| 2-layer full-width slice | 8 | 64 |" in out  # --quick: one KDA and one MLA layer


@pytest.mark.parametrize("devices", [3, 16])
def test_bench_refuses_device_counts_that_do_not_fit(capsys, devices):
    assert bench_expert_parallel.main(["--quick", "--devices", str(devices)]) == 2
    assert "error:" in capsys.readouterr().err


def test_bench_moe_devices_runs_the_expert_parallel_bench(monkeypatch):
    forwarded = []
    monkeypatch.setattr(bench_expert_parallel, "main", lambda argv: forwarded.append(argv) or 0)
    assert bench_moe.main(["--devices", "8", "--iters", "5"]) == 0
    assert forwarded == [["--devices", "8", "--iters", "5"]]
