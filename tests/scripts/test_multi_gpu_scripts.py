"""scripts/check_multi_gpu.py and benchmarks/moe/expert_parallel.py (run as python -m benchmarks.moe --devices N) in
their --quick modes on the 8 virtual CPU devices (conftest sets the XLA flag): both succeed, in fp32 the check
holds at 1e-4, and it fails on a model whose last expert shard is corrupted (so it can fail);
scripts/routing_sensitivity.py on a small model."""

from __future__ import annotations

import sys

import pytest
from helpers import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))

import check_multi_gpu  # noqa: E402
import routing_sensitivity  # noqa: E402

from benchmarks import moe as bench_moe  # noqa: E402
from benchmarks.moe import expert_parallel as bench_expert_parallel  # noqa: E402

# Fewer layers and tokens than --quick's defaults where nothing checks them: the run's cost is mostly compiling
# and initialising each layer, once on one device and twice on the mesh.
QUICK_CHECK = ["--quick", "--mesh", "expert=8", "--layers", "1", "--prompt-length", "8"]


@pytest.mark.usefixtures("module_compile_cache")
def test_check_passes_on_the_mesh(capsys):
    assert check_multi_gpu.main(QUICK_CHECK) == 0
    out = capsys.readouterr().out
    assert "2 layers (1 KDA + 1 MLA)" in out  # the reference size the quick memory budget allows
    assert "PASS" in out


@pytest.mark.usefixtures("module_compile_cache")
def test_check_in_float32_holds_at_1e_4(capsys):
    flags = ["--quick", "--mesh", "expert=2", "--dtype", "float32", "--reference-layers", "2", "--layers", "1"]
    flags += ["--prompt-length", "8"]
    assert check_multi_gpu.main(flags) == 0
    out = capsys.readouterr().out
    assert "float32 parameters" in out and "within 1e-04" in out


@pytest.mark.usefixtures("module_compile_cache")
def test_check_fails_when_the_last_expert_shard_is_corrupted(capsys):
    # one layer (MLA + MoE) shows the corrupted experts; the run stops before the large model
    assert check_multi_gpu.main(QUICK_CHECK + ["--reference-layers", "1", "--corrupt-last-shard"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_check_refuses_a_mesh_larger_than_the_devices(capsys):
    assert check_multi_gpu.main(["--quick", "--mesh", "expert=16"]) == 2
    assert "needs 16 devices, 8 present" in capsys.readouterr().err


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


def test_routing_sensitivity_reports_each_fraction(capsys):
    assert routing_sensitivity.main(["--hidden", "256", "--experts", "16"]) == 0
    out = capsys.readouterr().out
    errors = [float(part.split(": ")[1]) for part in out.strip().split("off: ")[1].split(", ")]
    assert len(errors) == 3 and errors[-1] > 0
