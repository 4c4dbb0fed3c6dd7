"""The one place that chooses the routed experts' kernels (`pallas_kernels.moe.ops.expert_path`): the documented
path per backend, rows of the call, expert format and FP8 mode; shapes only, nothing traced. The default path
(`pallas_kernels.moe.ops`, `ling_jax.moe`) imports no lab variant (`pallas_kernels.experimental`)."""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import pytest

from ling_jax.quantized import BlockFP8Weight, MXFP4Weight
from pallas_kernels.moe.ops import ExpertKernel, ExpertWeights, expert_path
from pallas_kernels.moe.tuned import ROW_PATH_MAX_ROWS

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXPERTS, WIDTH, HIDDEN = 4, 256, 128
SHAPES = ((EXPERTS, WIDTH, HIDDEN), (EXPERTS, WIDTH, HIDDEN), (EXPERTS, HIDDEN, WIDTH))


def stacks(fmt: str) -> ExpertWeights:
    """Abstract gate, up, down stacks stored as `fmt`: "bf16", "fp8" (128 x 128 blocks) or "mxfp4"."""
    shape = jax.ShapeDtypeStruct

    def stack(e, n, k):
        if fmt == "fp8":
            return BlockFP8Weight(
                shape((e, n, k), jnp.float8_e4m3fn), shape((e, n // 128, k // 128), jnp.float32), (128, 128)
            )
        if fmt == "mxfp4":
            return MXFP4Weight(shape((e, n, k // 2), jnp.uint8), shape((e, n, k // 32), jnp.float8_e8m0fnu))
        return shape((e, n, k), jnp.bfloat16)

    return ExpertWeights(*(stack(*s) for s in SHAPES))


# (backend, rows of the call (None: never row by row), format, fp8_matmul, rows already sorted) -> kernels
CASES = [
    ("reference", 8, "bf16", "auto", False, ExpertKernel.GROUPED),
    ("reference", 8, "fp8", "auto", False, ExpertKernel.GROUPED),
    ("reference", 8, "fp8", "w8a8", False, ExpertKernel.W8A8),
    ("reference", None, "fp8", "w8a8", True, ExpertKernel.GROUPED),
    ("interpret_tpu", 8, "fp8", "weight_only", False, ExpertKernel.GROUPED),
    ("interpret_tpu", 8, "fp8", "w8a8", False, ExpertKernel.W8A8),
    ("interpret_gpu", ROW_PATH_MAX_ROWS, "bf16", "auto", False, ExpertKernel.ROWS),
    ("interpret_gpu", ROW_PATH_MAX_ROWS + 1, "bf16", "auto", False, ExpertKernel.FUSED),
    ("interpret_gpu", 8, "fp8", "auto", False, ExpertKernel.ROWS),
    ("interpret_gpu", 8, "mxfp4", "auto", False, ExpertKernel.ROWS),
    ("interpret_gpu", 8, "fp8", "w8a8", False, ExpertKernel.W8A8),
    ("interpret_gpu", 8, "mxfp4", "w8a8", False, ExpertKernel.ROWS),
    ("pallas_gpu", 4096, "mxfp4", "w8a8", False, ExpertKernel.FUSED),
    ("pallas_gpu", None, "bf16", "auto", False, ExpertKernel.FUSED),
    ("pallas_gpu", ROW_PATH_MAX_ROWS, "fp8", "auto", False, ExpertKernel.ROWS),  # decode-sized: weight-only
    ("pallas_gpu", ROW_PATH_MAX_ROWS + 1, "fp8", "auto", False, ExpertKernel.W8A8),  # prefill-sized (> 4 an expert)
    ("pallas_gpu", ROW_PATH_MAX_ROWS + 1, "mxfp4", "auto", False, ExpertKernel.FUSED),
    ("pallas_gpu", 4096, "fp8", "weight_only", False, ExpertKernel.FUSED),
    ("reference", 4096, "fp8", "auto", False, ExpertKernel.GROUPED),  # a CPU: weight-only numerics
    ("pallas_gpu", None, "fp8", "auto", True, ExpertKernel.FUSED),  # a receive buffer's size tells no prefill
    ("pallas_gpu", None, "fp8", "w8a8", True, ExpertKernel.W8A8),
]


@pytest.mark.parametrize(("backend", "rows", "fmt", "fp8_matmul", "sorted_rows", "kernel"), CASES)
def test_the_documented_path(backend, rows, fmt, fp8_matmul, sorted_rows, kernel):
    path = expert_path(backend, stacks(fmt), fp8_matmul, rows=rows, sorted_rows=sorted_rows)
    assert path.kernel is kernel and path.backend == backend and not path.with_shared


def test_the_shared_expert_joins_the_row_kernels_at_the_routed_width():
    experts = stacks("bf16")
    same = (jax.ShapeDtypeStruct((WIDTH, HIDDEN), jnp.bfloat16),)
    other = (jax.ShapeDtypeStruct((WIDTH // 2, HIDDEN), jnp.bfloat16),)
    assert expert_path("interpret_gpu", experts, rows=8, shared=same).with_shared
    assert not expert_path("interpret_gpu", experts, rows=8, shared=other).with_shared
    assert not expert_path("interpret_gpu", experts, rows=ROW_PATH_MAX_ROWS + 1, shared=same).with_shared
    assert not expert_path("reference", experts, rows=8, shared=same).with_shared


def test_the_default_path_imports_no_lab_variant():
    modules = [ROOT / "pallas_kernels" / "moe" / "ops.py", *sorted((ROOT / "ling_jax" / "moe").glob("*.py"))]
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.startswith("pallas_kernels.experimental")], path
