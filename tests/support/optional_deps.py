"""The tests' guarded imports of what a machine may lack: the transformers models they compare against, and the
server's packages.

A transformers older than the test extra's pin lacks some of those models (the device image's 5.17 has no
`BailingHybridForCausalLM`), and the device image has no serve extra: the test module that needs one is then
skipped with a reason (naming the installed transformers version), instead of failing to collect. Called at a
module's top level a guard skips the whole module; inside a test or fixture, that test.
"""

from __future__ import annotations

import importlib

import pytest

SERVE_EXTRA = ("fastapi", "uvicorn", "prometheus_client")  # pyproject's `serve` extra, as imported


def from_transformers(module: str, *names: str) -> tuple:
    """`from module import *names` for transformers or one of its submodules, or a skip when they are missing."""
    transformers = pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")
    try:
        imported = importlib.import_module(module)
        return tuple(getattr(imported, name) for name in names)
    except (ImportError, AttributeError) as error:
        pytest.skip(
            f"the installed transformers {transformers.__version__} lacks the reference model ({error}); "
            "the test extra pins a transformers that has it",
            allow_module_level=True,
        )


def require_serve_extra() -> None:
    """Skip unless ling-serve's packages are installed."""
    for package in SERVE_EXTRA:
        pytest.importorskip(package, reason=f"ling-serve needs {package} (pip install -e '.[serve]')")
