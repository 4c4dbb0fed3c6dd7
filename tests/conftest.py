import os
import sys

import pytest

# Multi-device code is tested on 8 virtual CPU devices; this must be set before jax initialises a backend.
_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICES_FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES_FLAG}".strip()

# generate.py's persistent compilation cache stays off in tests (and their subprocesses): nothing in ~/.cache
os.environ.setdefault("LING_JAX_NO_COMPILE_CACHE", "1")

# The suite's time is mostly XLA:CPU compiling small programs, each run a few times: XLA's cheap optimisation
# level (LLVM -O0, no expensive passes) compiles them about 1.6x faster in all, subprocesses included (inherited).
# Numerics stay IEEE fp32 either way; an explicit JAX_DISABLE_MOST_OPTIMIZATIONS=0 keeps the full optimiser.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402  (after XLA_FLAGS)

import pallas_kernels  # noqa: E402,F401  (adds its XLA:CPU workaround flag before any test makes a backend)

_TESTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)


# The test files that use one pytest process's demo server (tests/serving/conftest.py's `demo_server`): one work unit
# of `--dist loadfile`, so that one pytest-xdist worker starts the server, not each.
DEMO_SERVER_FILES = {f"tests/serving/{name}.py" for name in ("test_server", "test_logprobs", "test_structured")}


DEMO_SERVER_UNIT = "the demo server's files"

# The work units that take a worker longest (about 40 s or more each in the 2026-12-05 CI run), longest first: handed
# out before the rest, so that the run ends on short files. pytest-xdist hands out files by their test count, largest
# first, which left these few-test files (a W8A8 model check, a training script, multi-process jobs) for the end, where
# one worker ran them while the other had nothing left.
LONGEST_UNITS = (
    "tests/multiprocess/test_serving.py",  # ~180 s, and its 4-process job's warm-up now compiles every program
    "tests/scripts/test_check_multi_gpu.py",
    "tests/scripts/test_multi_gpu_scripts.py",
    DEMO_SERVER_UNIT,
    "tests/serving/test_scheduler.py",
    "tests/training/test_train.py",
    "tests/generation/test_generate_cli_run.py",
    "tests/scripts/test_benchmarks.py",
    "tests/test_w8a8_model.py",
    "tests/convert/test_convert_memory.py",
    "tests/multiprocess/test_multiprocess.py",
)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without it
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (pyproject.toml) with DEMO_SERVER_FILES as one file and LONGEST_UNITS handed out first;
    other modes as pytest-xdist has them."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFirstDemoServerFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return DEMO_SERVER_UNIT if file in DEMO_SERVER_FILES else file

        def _assign_work_unit(self, node) -> None:
            longest = next((unit for unit in LONGEST_UNITS if unit in self.workqueue), None)
            if longest is not None:
                self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

    return LongestFirstDemoServerFilesTogether(config, log)


@pytest.fixture(scope="module")
def full_xla_optimisation():
    """XLA's full optimiser for the rest of a test module, in this process and in the subprocesses it starts: for
    tests whose programs run long enough that the cheap level's slower code costs more than it saves in compiling
    (Pallas kernels in interpret mode: each grid step a loop iteration of unoptimised code)."""
    saved = os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS")
    saved_flag = jax.config.read("jax_disable_most_optimizations")
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0"
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", saved_flag)
    if saved is None:
        del os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"]
    else:
        os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = saved


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module: one process runs the whole suite, and CPU
    executables otherwise accumulate for its full length."""
    yield
    jax.clear_caches()
