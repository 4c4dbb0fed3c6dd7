"""The entry points' XLA flags: added once, never over a flag the user set, valid for XLA (a CPU run parses them)."""

from __future__ import annotations

import os
import subprocess
import sys

from ling_jax import xla_flags


def test_flags_are_added_beside_the_users_and_never_over_them():
    environ = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer= --xla_dump_to=/tmp/x"}
    xla_flags.set_gpu_flags(environ)
    flags = environ["XLA_FLAGS"].split()
    assert flags[:2] == ["--xla_gpu_enable_command_buffer=", "--xla_dump_to=/tmp/x"]
    assert flags[2:] == ["--xla_gpu_graph_min_graph_size=1"]
    xla_flags.set_gpu_flags(environ)  # twice changes nothing
    assert environ["XLA_FLAGS"].split() == flags
    empty: dict[str, str] = {}
    xla_flags.set_gpu_flags(empty)
    assert empty["XLA_FLAGS"].split() == [f"{name}={value}" for name, value in xla_flags.GPU_FLAGS.items()]
    assert "WHILE" in xla_flags.GPU_FLAGS["--xla_gpu_enable_command_buffer"].split(",")
    off = {xla_flags.OFF_ENV: "0", "XLA_FLAGS": "--a=1"}
    xla_flags.set_gpu_flags(off)
    assert off["XLA_FLAGS"] == "--a=1"


def test_xla_accepts_the_flags():
    """XLA aborts the process on a flag it does not know: a run with every flag set computes."""
    environ = {**os.environ, "XLA_FLAGS": xla_flags.with_gpu_flags(os.environ.get("XLA_FLAGS", ""))}
    code = "import jax.numpy as jnp; print(int(jnp.arange(5).sum()))"
    result = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "10", result.stderr
