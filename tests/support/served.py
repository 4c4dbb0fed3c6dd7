"""`ling-serve` on the demo checkpoint as a subprocess on a free port of 127.0.0.1, for the server tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import pytest
from helpers import REPO_ROOT

START_TIMEOUT_S = 240


@contextlib.contextmanager
def served(log_dir, flags: list[str]):
    """`ling-serve` with `flags`, its log in `log_dir`: its URL once /health answers, until the block ends."""
    import httpx  # the server tests' client (the test extra): the test modules skip without it

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = log_dir / "server.log"
    command = [sys.executable, "-m", "ling_jax.serving", "--port", str(port), *flags]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with open(log, "w") as out:
        server = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(httpx, url):
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ling-serve did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        server.kill()
        server.wait()


def _healthy(httpx, url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
