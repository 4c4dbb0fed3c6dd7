"""Where a machine lacks the reference model or the server's packages (the device image: transformers 5.17, no
fastapi), the modules that need them skip with a reason instead of failing to collect."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
from optional_deps import from_transformers

TRANSFORMERS_WITHOUT_MODELS = types.SimpleNamespace(__version__="5.17.0")
NOT_INSTALLED = None  # a None in sys.modules makes its import raise ImportError


def test_a_missing_model_skips_naming_the_installed_version(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", TRANSFORMERS_WITHOUT_MODELS)
    with pytest.raises(pytest.skip.Exception) as skipped:
        from_transformers("transformers", "BailingHybridForCausalLM")
    assert skipped.value.allow_module_level
    assert "transformers 5.17.0 lacks the reference model" in skipped.value.msg
    assert "BailingHybridForCausalLM" in skipped.value.msg


@pytest.mark.parametrize(
    "module, package, stand_in",
    [
        ("oracle", "transformers", TRANSFORMERS_WITHOUT_MODELS),
        ("tests.serving.test_cli", "fastapi", NOT_INSTALLED),
        ("tests.serving.test_server", "fastapi", NOT_INSTALLED),
    ],
)
def test_a_module_that_needs_it_skips_on_import(module, package, stand_in, monkeypatch):
    monkeypatch.setitem(sys.modules, package, stand_in)
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(pytest.skip.Exception) as skipped:
        importlib.import_module(module)
    assert skipped.value.allow_module_level
    assert package in skipped.value.msg
