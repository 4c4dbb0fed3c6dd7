"""The scheduler's thread runs no command-line code: importing the scheduler loads no CLI module, checkpoint
loader or VL image code (a fresh interpreter, so nothing another test imported counts). Importing the serving and
generation code starts no jax backend: benchmarks.serve_http's client imports it before its ling-serve subprocess
takes the GPU's memory, which a backend started in the client (a jnp constant at import) would have taken first."""

from __future__ import annotations

import subprocess
import sys

COMMAND_LINE_MODULES = (
    "ling_jax.generation.cli",
    "ling_jax.generation.cli_checks",
    "ling_jax.generation.cli_runtime",
    "ling_jax.generation.flags",
    "ling_jax.checkpoints.orbax",
    "ling_jax.vl.image_processing",
    "ling_jax.vl.prompt",
)


def test_the_scheduler_imports_no_command_line_code():
    probe = (
        "import sys, ling_jax.serving.scheduler\n"
        f"print(sorted(m for m in {COMMAND_LINE_MODULES!r} if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_importing_the_serving_code_starts_no_backend():
    probe = (
        "import benchmarks.serve_http, ling_jax.serving.api\n"
        "from jax._src import xla_bridge\n"
        "print(sorted(xla_bridge._backends))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
