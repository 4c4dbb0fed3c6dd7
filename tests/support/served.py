"""`ling-serve` as a subprocess on a free port of 127.0.0.1, for the server tests, and the flags of the demo server
(tests/serving/conftest.py's `demo_server`)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest
from helpers import REPO_ROOT

from ling_jax.generation.cli_runtime import NO_CACHE_ENV

START_TIMEOUT_S = 600  # generous: a run of the suite compiles in other processes meanwhile

# The shared demo server's flags: 4 slots (decode buckets 1, 2 and 4: 8 slots' bucket 8 was two more programs to
# compile, a quarter of the warm-up) and a queue of 28 (32 requests at once) over a context of 128 in prefill chunks
# of 16 (up to 4 a step), in the batch-invariant mode (tests/serving/conftest.py's `demo_model`): a served request
# equals the request run alone.
DEMO_MAX_BATCH, DEMO_MAX_CONTEXT, DEMO_CHUNK, DEMO_BUDGET, DEMO_MAX_QUEUE = 4, 128, 16, 64, 28
DEMO_SERVER_FLAGS = (
    *("--max-batch", str(DEMO_MAX_BATCH), "--max-context", str(DEMO_MAX_CONTEXT)),
    *("--prefill-chunk", str(DEMO_CHUNK), "--prefill-budget", str(DEMO_BUDGET), "--max-queue", str(DEMO_MAX_QUEUE)),
    *("--fp8-matmul", "weight_only"),
)
# XLA's full optimisation: a served program runs hundreds of times (3x faster prefill, 2x decode than at the suite's
# cheap level), and the compile cache's key includes the level: a server that should compile nothing sets it too
DEMO_SERVER_ENV = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "0"}


@dataclasses.dataclass(frozen=True)
class Server:
    """A started `ling-serve`: its process, its URL and its log (stdout and stderr)."""

    process: subprocess.Popen
    url: str
    log: pathlib.Path

    def ready(self) -> str:
        """The URL once /health answers (the model is loaded and compiled by then); fails with the log's tail if
        the server exits or does not answer in START_TIMEOUT_S."""
        import httpx  # the server tests' client (the test extra): the test modules skip without it

        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(httpx, self.url):
            if self.process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ling-serve did not start (exit {self.process.poll()}):\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)
        return self.url


@contextlib.contextmanager
def started(log_dir, flags, env=None, compile_cache=None):
    """`ling-serve` with `flags` (and `env` on top of this process's), its log in `log_dir`, started but not waited
    for (`Server.ready`), killed when the block ends. With `compile_cache` (a directory), its compiled programs go
    to and come from that persistent cache: another server with the same program-shaping flags then compiles none."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = pathlib.Path(log_dir) / "server.log"
    command = [sys.executable, "-m", "ling_jax.serving", "--port", str(port), *flags]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    if compile_cache is not None:  # tests/conftest.py turns the cache off for the suite's processes
        env |= {NO_CACHE_ENV: "0", "JAX_COMPILATION_CACHE_DIR": str(compile_cache)}
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield Server(process, f"http://127.0.0.1:{port}", log)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def _healthy(httpx, url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
