"""scripts/compile_tpu_kernels.py: the weight-only and MLA decode TPU kernels compiled by libtpu (Mosaic included)
for v5e at the test sizes. libtpu stays out of the project's environment: the test runs where LING_LIBTPU_DIR
names a directory holding it (`pip install --no-deps --target DIR 'libtpu==0.0.42.*'`), and is skipped elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import REPO_ROOT

LIBTPU_DIR = os.environ.get("LING_LIBTPU_DIR")


@pytest.mark.skipif(not LIBTPU_DIR, reason="needs libtpu: set LING_LIBTPU_DIR (module docstring)")
def test_kernels_compile_for_v5e():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([LIBTPU_DIR, str(REPO_ROOT)])}
    script = REPO_ROOT / "scripts" / "compile_tpu_kernels.py"
    run = subprocess.run(
        [sys.executable, str(script), "--quick", "--chips", "v5e"], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    assert run.stdout.count("TPU v5 lite") == 42 and "FAILED" not in run.stdout
