"""`python -m tests.gpu_suite`: the two groups split the test files between them, and a test phase is stopped at
its time limit."""

from __future__ import annotations

import signal
import time

import pytest

from tests import gpu_suite


def test_each_group_1_pattern_names_files_and_group_2_ignores_them():
    for pattern in gpu_suite.GROUP_1_PATTERNS:
        assert list(gpu_suite.REPO_ROOT.glob(pattern)), f"{pattern} names no test file"
    group_1 = gpu_suite.group_args(1)
    group_2 = gpu_suite.group_args(2)
    assert str(gpu_suite.REPO_ROOT / "tests/kernels/test_kda_chunk.py") in group_1
    assert str(gpu_suite.REPO_ROOT / "tests") in group_2 and str(gpu_suite.REPO_ROOT / "tests") not in group_1
    ignored = [arg.removeprefix("--ignore-glob=") for arg in group_2 if arg.startswith("--ignore-glob=")]
    assert ignored == [str(gpu_suite.REPO_ROOT / pattern) for pattern in gpu_suite.GROUP_1_PATTERNS]
    assert group_1[:2] == group_2[:2] == ["-m", "gpu"]
    assert "tests.gpu_suite" in group_1 and group_1[group_1.index("-n") + 1] == str(gpu_suite.WORKERS)
    assert "-n" not in gpu_suite.group_args(1, workers=0)


def test_a_phase_past_its_limit_raises_and_the_alarm_is_cleared():
    with pytest.raises(TimeoutError, match="a test ran past 1 s"), gpu_suite.time_limit(1, "a test"):
        time.sleep(5)
    with gpu_suite.time_limit(1, "a quick test"):
        pass
    assert signal.alarm(0) == 0  # no alarm left behind
