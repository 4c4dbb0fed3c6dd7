"""scripts/check_multi_gpu.py in its --quick mode on the 8 virtual CPU devices (conftest sets the XLA flag): it
succeeds, in fp32 it holds at 1e-4, and it fails on a model whose last expert shard is corrupted (so it can fail).
Its runs share a persistent compilation cache (`module_compile_cache`): the corrupted-shard run's one-layer model
on the mesh loads the programs the passing run's one-layer run compiled."""

from __future__ import annotations

import sys

import pytest
from helpers import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))

import check_multi_gpu  # noqa: E402

pytestmark = pytest.mark.usefixtures("module_compile_cache")

# Fewer layers and tokens than --quick's defaults where nothing checks them: the run's cost is mostly compiling
# and initialising each layer, once on one device and twice on the mesh.
QUICK_CHECK = ["--quick", "--mesh", "expert=8", "--layers", "1", "--prompt-length", "8"]


def test_check_passes_on_the_mesh(capsys):
    assert check_multi_gpu.main(QUICK_CHECK) == 0
    out = capsys.readouterr().out
    assert "2 layers (1 KDA + 1 MLA)" in out  # the reference size the quick memory budget allows
    assert "PASS" in out


def test_check_in_float32_holds_at_1e_4(capsys):
    flags = ["--quick", "--mesh", "expert=2", "--dtype", "float32", "--reference-layers", "2", "--layers", "1"]
    flags += ["--prompt-length", "8"]
    assert check_multi_gpu.main(flags) == 0
    out = capsys.readouterr().out
    assert "float32 parameters" in out and "within 1e-04" in out


def test_check_fails_when_the_last_expert_shard_is_corrupted(capsys):
    # one layer (MLA + MoE) shows the corrupted experts; the run stops before the large model
    assert check_multi_gpu.main(QUICK_CHECK + ["--reference-layers", "1", "--corrupt-last-shard"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_check_refuses_a_mesh_larger_than_the_devices(capsys):
    assert check_multi_gpu.main(["--quick", "--mesh", "expert=16"]) == 2
    assert "needs 16 devices, 8 present" in capsys.readouterr().err
