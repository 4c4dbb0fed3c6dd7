"""scripts/compile_gpu_kernels.py: every Triton kernel of full-size Ling-3.0-flash's decode step (batch 1) and MTP
speculative round, lowered for CUDA on the CPU, compiles for Hopper (sm_90) with Triton's own compiler within the
SM's shared memory (the test extra pins the device image's Triton), the round's FP8 gemvs within 128 registers a
thread, unspilled. Skipped where Triton is not importable."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from helpers import REPO_ROOT


def _script():
    spec = importlib.util.spec_from_file_location(
        "compile_gpu_kernels", REPO_ROOT / "scripts" / "compile_gpu_kernels.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_decode_and_verify_kernels_compile_for_hopper(capsys):
    pytest.importorskip("triton", reason="needs Triton: the test extra pins triton==3.6.0")
    assert _script().main(["--programs", "decode,verify", "--batches", "1"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| kernel")]
    names = {row.split(" | ")[0].removeprefix("| ") for row in rows}
    assert {"kda_decode_fused", "kda_verify_fused", "select_experts", "mla_decode_split"} <= names, out
    assert "FAILED" not in out and " OVER" not in out, out
    # the verify pass's gemvs run 2 rows (FMA products): their row bucket's tiles keep 4 programs an SM, no spills
    cells = [row.split(" | ") for row in rows if row.startswith("| weight_only_gemv") and "verify" in row]
    assert cells and all(int(cell[4]) <= 128 and cell[5] == "0" for cell in cells), out
