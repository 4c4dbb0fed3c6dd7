"""Run a command and measure its own peak RSS (for the benchmark and the bounded-memory test).

A child's ru_maxrss starts from its parent's RSS at fork/exec (Linux carries the old address space's
high-water mark across exec), so a direct child of a process holding 1 GB reports >= 1 GB whatever it does.
The command therefore runs under a small Python launcher, whose own footprint (~10 MB) is all it inherits;
the launcher reaps it with wait4 and hands back its rusage.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import time

_LAUNCHER = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
child.returncode = os.waitstatus_to_exitcode(status)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
sys.exit(child.returncode)
"""


@dataclasses.dataclass(frozen=True)
class Measured:
    returncode: int
    peak_rss: int  # bytes
    seconds: float
    stdout: str
    stderr: str


def run_measured(argv: list[str], *, cwd: str | None = None, env: dict | None = None) -> Measured:
    with tempfile.TemporaryDirectory() as scratch:
        rusage_file = os.path.join(scratch, "maxrss")
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", _LAUNCHER, rusage_file, *argv], cwd=cwd, env=env, capture_output=True, text=True
        )
        seconds = time.perf_counter() - start
        with open(rusage_file) as f:
            peak_kib = int(f.read())
    return Measured(done.returncode, peak_kib * 1024, seconds, done.stdout, done.stderr)
