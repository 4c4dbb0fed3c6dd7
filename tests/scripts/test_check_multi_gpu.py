"""scripts/check_multi_gpu.py in its --quick mode on the 8 virtual CPU devices (conftest sets the XLA flag): it
succeeds, in fp32 it holds at 1e-4, and each run's self-test (the last expert shard corrupted in place, the same
compiled programs run again) fails the comparison, so the check can fail; a comparison that fails ends the run
with exit code 1 before the large run."""

from __future__ import annotations

import sys

import numpy as np
from helpers import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))

import check_multi_gpu  # noqa: E402

# Fewer layers and tokens than --quick's defaults where nothing checks them: the run's cost is mostly compiling
# each model's programs, once on one device and once on the mesh; --layers equal to the reference's 2 (one KDA,
# one MLA layer) makes the large run the mesh run already made.
QUICK_CHECK = ["--quick", "--mesh", "expert=8", "--layers", "2", "--prompt-length", "8"]


def test_check_passes_on_the_mesh(capsys):
    assert check_multi_gpu.main(QUICK_CHECK) == 0
    out = capsys.readouterr().out
    assert "2 layers (1 KDA + 1 MLA)" in out  # the reference size the quick memory budget allows
    assert "last expert shard scaled by 2.0" in out and "(caught at 2e-02)" in out
    assert "2 layers on the mesh: the run above" in out
    assert "PASS" in out


def test_check_in_float32_holds_at_1e_4(capsys):
    # one MLA + MoE layer: the experts are what the expert axis splits (a KDA layer there is only batch-split, and
    # the bf16 check above runs one on the mesh); two layers cost 44 CPU-s against 28
    flags = ["--quick", "--mesh", "expert=2", "--dtype", "float32", "--reference-layers", "1", "--layers", "1"]
    flags += ["--prompt-length", "8"]
    assert check_multi_gpu.main(flags) == 0
    out = capsys.readouterr().out
    assert "float32 parameters" in out and "within 1e-04" in out and "(caught at 1e-04)" in out


def test_check_fails_when_the_mesh_differs_or_the_self_test_is_not_caught(monkeypatch, capsys):
    # the control flow alone, on made-up logits: no model is built
    inputs = check_multi_gpu.make_inputs(64, 2, 4, 1)
    rng = np.random.default_rng(0)
    reference = check_multi_gpu.Logits(forward=rng.normal(size=(2, 5, 64)), cached=rng.normal(size=(2, 2, 64)))
    far = check_multi_gpu.Logits(forward=2 * reference.forward, cached=2 * reference.cached)
    monkeypatch.setattr(check_multi_gpu, "make_inputs", lambda *args: inputs)
    monkeypatch.setattr(check_multi_gpu, "build_model", lambda *args, **kwargs: (None, None))
    monkeypatch.setattr(check_multi_gpu, "move_to_mesh", lambda *args: None)
    flags = ["--quick", "--layers", "2", "--reference-layers", "2"]
    for on_mesh, caught, message in (
        (far, True, "differ from one device by more than 2e-02"),
        (reference, False, "corrupted do not fail the check at 2e-02"),
    ):
        runs = iter((reference, on_mesh))  # one device, then the mesh
        monkeypatch.setattr(check_multi_gpu, "run_logits", lambda *args, runs=runs: next(runs))
        monkeypatch.setattr(check_multi_gpu, "self_test", lambda *args, caught=caught: caught)
        assert check_multi_gpu.main(flags) == 1
        out = capsys.readouterr().out
        assert f"FAIL: 2-layer logits on mesh {{'expert': 8}} {message}; the 2-layer run is skipped" in out


def test_check_refuses_a_mesh_larger_than_the_devices(capsys):
    assert check_multi_gpu.main(["--quick", "--mesh", "expert=16"]) == 2
    assert "needs 16 devices, 8 present" in capsys.readouterr().err
