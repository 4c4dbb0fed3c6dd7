"""Real multi-process runs on this machine: N Python processes, each with its own CPU devices, joined through
`jax.distributed` (process 0 runs the coordination service on a free local port) and talking over gloo."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import pytest
from helpers import REPO_ROOT, SUBPROCESS_XLA_FLAGS

LAUNCH_TIMEOUT_S = 400  # the whole launch; every process is killed past it


@dataclasses.dataclass(frozen=True)
class Finished:
    returncode: int
    stdout: str
    stderr: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(devices: int) -> dict[str, str]:
    """A process's environment: `devices` CPU devices (and the suite's faster-compiling XLA:CPU emitters), the
    repository and tests/support importable."""
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {SUBPROCESS_XLA_FLAGS}",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests" / "support")]),
    }


def _launch(
    command: Callable[[int, str], list[str]], processes: int = 2, devices: int = 2, timeout_s: float = LAUNCH_TIMEOUT_S
) -> list[Finished]:
    coordinator = f"127.0.0.1:{free_port()}"
    env = environment(devices)
    children: list[subprocess.Popen] = []
    timed_out = False
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as files:
        outputs = [
            [files.enter_context(open(os.path.join(logs, f"{i}.{kind}"), "w+")) for kind in ("out", "err")]
            for i in range(processes)
        ]
        try:
            for process_id, (out, err) in enumerate(outputs):
                children.append(
                    subprocess.Popen(
                        [sys.executable, *command(process_id, coordinator)],
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=err,
                        env=env,
                        cwd=REPO_ROOT,
                    )
                )
            deadline = time.monotonic() + timeout_s
            for child in children:
                child.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
        finished = []
        for process_id, (child, (out, err)) in enumerate(zip(children, outputs)):
            out.seek(0)
            err.seek(0)
            finished.append(Finished(child.returncode, out.read(), err.read()))
            print(f"--- process {process_id}: exit status {child.returncode}, stderr:\n{finished[-1].stderr}")
    if timed_out:
        pytest.fail(f"the {processes} processes did not all finish within {timeout_s} s (killed); see their stderr")
    return finished


@pytest.fixture(scope="session")
def launch() -> Callable[..., list[Finished]]:
    """launch(command, processes=2, devices=2, timeout_s=LAUNCH_TIMEOUT_S): run `python *command(process_id,
    coordinator_address)` as `processes` processes of `devices` CPU devices each and wait for all of them. Their
    output goes to files (a full pipe would stall a process the others wait for) and their stderr is printed
    afterwards, which pytest shows when the test fails. Past `timeout_s` every process still running is killed
    and the test fails."""
    return _launch
