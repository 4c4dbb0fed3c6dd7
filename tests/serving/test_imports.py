"""The scheduler's thread runs no command-line code: importing the scheduler loads no CLI module, checkpoint
loader or VL image code (a fresh interpreter, so nothing another test imported counts)."""

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
