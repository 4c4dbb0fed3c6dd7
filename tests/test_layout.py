"""The package layout holds: the public names import from `ling_jax`, the model core imports no wing, and the
config / presets and config / config_json cycles stay gone. Imports are read from the source (function-level
ones included)."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest
from helpers import REPO_ROOT

import ling_jax

PACKAGE = REPO_ROOT / "ling_jax"
WINGS = (
    "ling_jax.vl",
    "ling_jax.checkpoints",
    "ling_jax.generation",
    "ling_jax.training",
    "ling_jax.serving",
    "ling_jax.build",
)
PUBLIC = {
    "CheckpointError",
    "ExecutionPolicy",
    "GenerationStats",
    "Generator",
    "KDAMode",
    "KDAState",
    "KernelBackend",
    "LingCache",
    "LingConfig",
    "LingForCausalLM",
    "LingOutput",
    "LingVLConfig",
    "LingVLForConditionalGeneration",
    "MLAMode",
    "MLAState",
    "MTPCache",
    "MoEExchange",
    "PagedMLAState",
    "FP8Matmul",
    "PRESETS",
    "QuantizationConfig",
    "RULES",
    "RopeConfig",
    "SamplingParams",
    "ShardedLM",
    "TrainConfig",
    "build_model",
    "functional",
    "load_checkpoint",
    "load_hf_checkpoint",
    "load_model_config",
    "load_tokenizer",
    "make_mesh",
    "preset",
    "shard_model",
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("ling_jax")}


def _core_modules() -> list[pathlib.Path]:
    top = [p for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "build.py")]
    return sorted(top + list((PACKAGE / "moe").glob("*.py")))


def test_public_api_is_the_listed_names_and_each_imports():
    assert set(ling_jax.__all__) == PUBLIC
    for name in sorted(PUBLIC):
        assert getattr(ling_jax, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        ling_jax.nonexistent  # noqa: B018


def test_public_names_are_the_defining_modules_objects():
    assert ling_jax.Generator is importlib.import_module("ling_jax.generation.generator").Generator
    assert ling_jax.preset("tiny") is ling_jax.PRESETS["tiny"]


@pytest.mark.parametrize("path", _core_modules(), ids=lambda p: _module_name(p))
def test_core_imports_no_wing(path):
    wings = sorted(i for i in _imports(path) if i.startswith(WINGS))
    assert not wings, f"{_module_name(path)} (model core) imports {wings}"


def test_config_does_not_import_presets():
    assert not {i for i in _imports(PACKAGE / "config.py") if i.startswith("ling_jax.presets")}


def test_config_json_imports_no_ling_jax_module():
    """config.py imports config_json (the parser), never the other way round."""
    assert not _imports(PACKAGE / "config_json.py")
