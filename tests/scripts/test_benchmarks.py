"""CI's smoke run of the benchmarks (`python -m benchmarks.NAME`): each runs its `--quick` mode in-process, at
sizes that keep the whole file near a minute on two cores. Those that time only GPU kernels (Triton, Mosaic) stop
at their arguments on a CPU (they need a GPU, and say so) and run their `--quick` mode on the device machine
(`pytest -m gpu`). benchmarks.generate's run profiles its decode steps (`--profile`, its own test). Run elsewhere:
benchmarks.generate_cli (tests/generation/test_generate_cli_run.py), the expert-parallel measurement
(tests/scripts/test_multi_gpu_scripts.py), benchmarks.figures (tests/docs/test_figures.py). benchmarks.serve only parses
its arguments here: its --quick run compiles the serving engine's programs (~45 s of CPU), whose scheduler tests/serving
runs; benchmarks.serve_http's --quick run (the served path over real HTTP, which no other benchmark runs) starts
`ling-serve --preset tiny` on one device (~30 s of CPU with its static steps)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import ONE_DEVICE_XLA_FLAGS, REPO_ROOT

from benchmarks import trace
from benchmarks.common import PROFILE_STEPS
from ling_jax.generation.memory_plan import Hardware

ON_CPU = pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU runs; on a GPU the gpu-marked ones run")
ON_GPU = pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="times GPU kernels only; runs on the device machine (pytest -m gpu)"
)

# (module, its arguments, a line of what it prints): the CPU part, smallest sizes
CPU_RUNS = {
    "fp8_peak": ("benchmarks.fp8_peak", ["--quick"], "jax fp8"),
    "moe": (
        "benchmarks.moe",
        ["--quick", "--iters", "1", "--no-sweep", "--tokens", "16", "--backend", "reference"],
        "| 16 | fused: whole MoE layer |",
    ),
    "kda": ("benchmarks.kda", ["--quick", "--variant", "gpu_triton"], "| prefill | 1 | 192 |"),
    "kda --decode-fused": ("benchmarks.kda", ["--decode-fused", "--quick"], "| 3 | "),
    "kda_conv": ("benchmarks.kda_conv", ["--quick"], "| 10 left pads | "),
    "convert": ("benchmarks.convert", ["--quick", "--dtypes", "fp8", "--workers", "1"], "| fp8 | 1 |"),
    "load_memory": ("benchmarks.load_memory", ["--quick", "--mesh", "expert=2"], "within the bound"),
    "generate --mtp": (
        "benchmarks.generate",
        ["--quick", "--preset", "tiny", "--weights", "stored", "--batches", "1", "--decode-only", "--mtp", "1"]
        + ["--layers", "2"]  # the preset's first 2 of its 4 layers: a KDA + dense MLP, an MLA + MoE layer
        + ["--variants", "gemv.min_programs=16:mla.min_split=64"],
        (
            "2 layers ('kda', 'mla')",
            "KDA decode auto, gemv.min_programs 16, mla.min_split 64: prefill",
            "MTP 1 draft(s), specialised sampling: generate.py's decode step",
            "program of speculative rounds:",
        ),
    ),
    "load_rate": ("benchmarks.load_rate", ["--quick", "--workers", "1,2"], "load_hf_checkpoint (2 workers)"),
    "random_init": ("benchmarks.random_init", ["--preset", "tiny", "--compile-only"], "4 programs for 5"),
    # a ling-serve --preset tiny subprocess (its untimed first request a closed loop of one client), then the static
    # Generator step at the one concurrency
    "serve_http": ("benchmarks.serve_http", ["--quick", "--concurrency", "2"], "| 2 | 3 | "),
}
# (module, its --quick arguments): the GPU kernels only
GPU_RUNS = {
    "mla": ("benchmarks.mla", ["--quick", "--iters", "2"]),
    "mla_prefill": ("benchmarks.mla_prefill", ["--quick", "--iters", "2"]),
    "fp8_linear": ("benchmarks.fp8_linear", ["--quick"]),
    "fp8_linear --sweep gpu_triton_gemv": (
        "benchmarks.fp8_linear",
        ["--quick", "--sweep", "gpu_triton_gemv", "--rows", "1,3"],
    ),
    "fp8_linear --sweep gemv-gated-norm": ("benchmarks.fp8_linear", ["--quick", "--sweep", "gemv-gated-norm"]),
    "moe": ("benchmarks.moe", ["--quick", "--iters", "2", "--no-sweep"]),
    "moe --path rows": ("benchmarks.moe", ["--path", "rows", "--quick", "--iters", "2"]),
    "moe --grouped-matmul-sweep": (
        "benchmarks.moe",
        ["--grouped-matmul-sweep", "--rows", "8", "--quick", "--iters", "2"],
    ),
    "moe --format fp8 mxfp4": ("benchmarks.moe", ["--format", "fp8", "mxfp4", "--quick", "--iters", "2"]),
    "moe --fp8-matmul w8a8": ("benchmarks.moe", ["--fp8-matmul", "w8a8", "--quick", "--iters", "2", "--sweep"]),
}


def test_generate_refuses_a_model_the_device_cannot_hold_before_initialising_it(capsys, monkeypatch):
    """A full preset on a device of 80 GB (as an H100 reports it): one line naming the weights, the per-device
    figures and what would fit, before any weight is initialised."""
    module = importlib.import_module("benchmarks.generate")
    monkeypatch.setattr(module, "device_memory", lambda: Hardware("NVIDIA H100 80GB HBM3", 80 * 10**9, 1.0, "test"))
    monkeypatch.setattr(module, "random_model", lambda *a, **k: pytest.fail("initialised a model that cannot fit"))
    argv = ["--preset", "ling-3.0-flash", "--weights", "stored", "--batches", "1", "--context", "32768"]
    with pytest.raises(SystemExit) as stopped:
        module.main([*argv, "--prefill-only"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--weights stored: the model does not fit:" in err and "on NVIDIA H100 80GB HBM3" in err
    assert "--no-memory-check" not in err and "--mesh" in err


@ON_CPU
@pytest.mark.parametrize("name", sorted(CPU_RUNS))
def test_quick_run(name, capsys, tmp_path, monkeypatch):
    module, argv, printed = CPU_RUNS[name]
    if name == "serve_http":  # its server on one device with the faster-compiling emitters, as a user's CPU run
        monkeypatch.setenv("XLA_FLAGS", ONE_DEVICE_XLA_FLAGS)
    if name in ("convert", "load_memory", "load_rate"):
        argv = [*argv, "--workdir", str(tmp_path / name)]
    if name == "generate --mtp":  # also traces generate.py's programs of decode steps and speculative rounds
        argv = [*argv, "--steps", "2", "--profile", str(tmp_path / "prof"), "--sampling", "general,specialised"]
    assert importlib.import_module(module).main(argv) == 0
    out = capsys.readouterr().out
    assert all(text in out for text in ((printed,) if isinstance(printed, str) else printed))


@ON_CPU
def test_generate_quick_run_profiles_its_decode_steps_by_layer_kind(capsys, tmp_path):
    """benchmarks.generate's smoke run with --profile prints, from the trace of its decode steps (on a CPU the XLA
    ops the host runs), the kernels per step and the device time per layer kind, every kernel counted once; and
    scripts/trace_summary.py prints the same table from the same directory (one parser: benchmarks.trace)."""
    profile = tmp_path / "prof"
    argv = ["--quick", "--batches", "1", "--steps", "2", "--weights", "bf16", "--decode-only"]
    argv += ["--profile", str(profile)]
    assert importlib.import_module("benchmarks.generate").main(argv) == 0
    out = capsys.readouterr().out
    assert "| bf16 | auto | n/a | 1 | 512 |" in out
    hlo_text = (profile / trace.HLO_FILE).read_text()
    kernels = trace.kernels(trace.load_trace(trace.find_trace(profile)), trace.hlo_module_name(hlo_text))
    scopes = trace.hlo_scopes(hlo_text)
    by_kind = trace.time_by_layer_kind(kernels, scopes)
    assert sum(count for count, _ in by_kind.values()) == len(kernels) > 0
    assert all(by_kind[kind][0] > 0 for kind in ("KDA layer", "MLA layer", "MoE / dense FFN", "lm_head / sampling"))
    table = trace.layer_kind_table(kernels, scopes, PROFILE_STEPS)
    assert f"{len(kernels) / PROFILE_STEPS:.0f} kernels and" in table and table in out
    script = [sys.executable, str(REPO_ROOT / "scripts" / "trace_summary.py"), str(profile), "--steps", "5"]
    assert table in subprocess.run(script, capture_output=True, text=True, check=True).stdout


@ON_CPU
def test_generate_prefill_only_profiles_a_prefill_call_by_layer_kind(capsys, tmp_path):
    """With --prefill-only, --profile traces one more prefill of the prompt under the first --kda-prefill and
    --mla-prefill kernels (DIR/prefill_KDA_MLA) and prints its table per prefill call: here 2 calls of 64 tokens;
    the prefill is timed with and without command buffers."""
    argv = ["--quick", "--batches", "1", "--weights", "bf16", "--prefill-only", "--context", "128"]
    argv += ["--prefill-tokens", "64", "--profile", str(tmp_path / "prof"), "--prefill-command-buffers", "on,off"]
    assert importlib.import_module("benchmarks.generate").main(argv) == 0
    out = capsys.readouterr().out
    names = "KDA prefill default, MLA prefill default"
    assert f"{names}, command buffers on:" in out and f"{names}, command buffers off:" in out
    profile = tmp_path / "prof" / "prefill_default_default"
    hlo_text = (profile / trace.HLO_FILE).read_text()
    kernels = trace.kernels(trace.load_trace(trace.find_trace(profile)), trace.hlo_module_name(hlo_text))
    by_kind = trace.time_by_layer_kind(kernels, trace.hlo_scopes(hlo_text))
    assert all(by_kind[kind][0] > 0 for kind in ("KDA layer", "MLA layer", "MoE / dense FFN"))
    assert f"{names}, a prefill call by layer kind:" in out
    assert trace.layer_kind_table(kernels, trace.hlo_scopes(hlo_text), 2) in out


@ON_CPU
@pytest.mark.parametrize("name", sorted(GPU_RUNS))
def test_gpu_benchmark_stops_at_its_arguments_without_a_gpu(name, capsys):
    module, argv = GPU_RUNS[name]
    with pytest.raises(SystemExit) as stop:  # without --quick: some interpret their kernels on a CPU, for minutes
        importlib.import_module(module).main([arg for arg in argv if arg != "--quick"])
    assert stop.value.code == 2
    assert "needs a GPU" in capsys.readouterr().err


@pytest.mark.gpu
@ON_GPU
@pytest.mark.parametrize("name", sorted(GPU_RUNS))
def test_gpu_benchmark_quick_run(name):
    module, argv = GPU_RUNS[name]
    assert importlib.import_module(module).main(argv) == 0


def test_serve_parses_its_arguments(capsys):
    with pytest.raises(SystemExit) as stop:
        importlib.import_module("benchmarks.serve").main(["--quick", "--help"])
    assert stop.value.code == 0 and "--prefix-tokens" in capsys.readouterr().out


def test_moe_flags_pick_one_measurement(capsys):
    benchmarks_moe = importlib.import_module("benchmarks.moe")
    with pytest.raises(SystemExit):
        benchmarks_moe.main(["--devices", "2", "--format", "fp8"])
    assert "drop --format / --path" in capsys.readouterr().err


def test_w8a8_balanced_routing_gives_every_expert_the_same_rows():
    """`benchmarks.moe --fp8-matmul w8a8 --balanced`: 24 tokens, top-4 of 12 experts: 8 rows each, a token's
    experts distinct."""
    random_problem = importlib.import_module("benchmarks.moe.w8a8").random_problem
    experts_TK = np.asarray(random_problem(24, 8, 8, 12, 4, balanced=True)[2])
    assert np.array_equal(np.bincount(experts_TK.ravel(), minlength=12), np.full(12, 8))
    assert all(len(set(row)) == 4 for row in experts_TK.tolist())
