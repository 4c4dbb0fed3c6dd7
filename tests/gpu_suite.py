"""The GPU tests (`pytest -m gpu`) in two halves, each one device call of under 5 minutes:

    python -m tests.gpu_suite 1    # the KDA, MLA, RMSNorm and FP8-linear kernels' test files
    python -m tests.gpu_suite 2    # every other test file: the MoE kernels, the W8A8 model, the scheduler

Group 1 is named by file patterns (they survive a file split or rename within a kernel's tests) and group 2 is the
rest of tests/, so every GPU test runs in exactly one group. Each test's setup, call and teardown is failed past
`TEST_TIMEOUT_S`; one stuck in native code past twice that ends the run with every thread's traceback. Arguments
after the group go to pytest (`-k`, `-x`, ...); the slowest tests' times are printed, to rebalance the groups.

Most of the suite's time is compiling (XLA and Triton, single-threaded per program), so the tests run in
`--workers` pytest-xdist processes (default 4) sharing the GPU, each allocating GPU memory as it needs it and
freeing it when done (`XLA_PYTHON_CLIENT_ALLOCATOR=platform`: with XLA's default pool, the first workers' pools
kept what the next needed and tests ran out of memory); this module is loaded as a plugin in every worker
(`-p tests.gpu_suite`), where its hooks apply the time limit.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
GROUP_1_PATTERNS = (
    "tests/kernels/test_kda_*.py",
    "tests/kernels/test_mla_*.py",
    "tests/kernels/test_rms_norm*.py",
    "tests/kernels/test_fp8_*.py",
)
TEST_TIMEOUT_S = 120
WORKERS = 4
TIMEOUT_ENV = "LING_GPU_TEST_TIMEOUT_S"  # set by `main` for the workers' hooks below


def group_args(group: int, workers: int = WORKERS) -> list[str]:
    """The files or ignore patterns of one group, with the GPU mark selected, this module as the workers' plugin and
    `workers` xdist processes (0: none) handed tests one by one (a kernel's test file takes longer than a group)."""
    parallel = ["-n", str(workers), "--dist", "load"] if workers else ["-p", "no:xdist"]
    common = ["-m", "gpu", "-o", "addopts=-ra", "--durations=15", "-p", "tests.gpu_suite", *parallel]
    if group == 1:
        return [*common, *map(str, group_1_files())]
    return [
        *common,
        str(REPO_ROOT / "tests"),
        *(f"--ignore-glob={REPO_ROOT / pattern}" for pattern in GROUP_1_PATTERNS),
    ]


def group_1_files() -> list[Path]:
    return sorted(path for pattern in GROUP_1_PATTERNS for path in REPO_ROOT.glob(pattern))


@contextlib.contextmanager
def time_limit(seconds: int, what: str) -> Iterator[None]:
    """Raise TimeoutError in the main thread past `seconds`; past twice that (a native call that never returns to
    Python), dump every thread's traceback and exit."""

    def expire(signum, frame):
        raise TimeoutError(f"{what} ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    faulthandler.dump_traceback_later(2 * seconds, exit=True)
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)


def _limit(what: str):
    seconds = int(os.environ.get(TIMEOUT_ENV, "0"))
    return time_limit(seconds, what) if seconds else contextlib.nullcontext()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _limit(f"{item.nodeid} setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _limit(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    with _limit(f"{item.nodeid} teardown"):
        return (yield)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu_suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("group", type=int, choices=(1, 2))
    parser.add_argument("--timeout", type=int, default=TEST_TIMEOUT_S, help="seconds per test phase")
    parser.add_argument("--workers", type=int, default=WORKERS, help="pytest-xdist processes sharing the GPU (0: none)")
    args, pytest_extra = parser.parse_known_args(argv)
    os.environ[TIMEOUT_ENV] = str(args.timeout)
    os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    return pytest.main([*group_args(args.group, args.workers), *pytest_extra])


if __name__ == "__main__":
    sys.exit(main())
