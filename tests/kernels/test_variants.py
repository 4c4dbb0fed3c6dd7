"""Kernel variants by name and the tuning tables: every op's registry, the errors for an unknown or misplaced
variant, the table lookup order, and that every table has a default for unknown devices."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tuning
from pallas_kernels.fp8 import ops as fp8_ops
from pallas_kernels.fp8 import tuned as fp8_tuned
from pallas_kernels.kda import chunk_kda, kda_decode_step
from pallas_kernels.kda import ops as kda_ops
from pallas_kernels.kda import tuned as kda_tuned
from pallas_kernels.mla import ops as mla_ops
from pallas_kernels.mla import tuned as mla_tuned
from pallas_kernels.moe import ops as moe_ops
from pallas_kernels.moe import tuned as moe_tuned
from pallas_kernels.norm import ops as norm_ops
from pallas_kernels.norm import tuned as norm_tuned
from pallas_kernels.tuning import ANY, H200, Entry

OPS = (fp8_ops, kda_ops, mla_ops, moe_ops, norm_ops)
TABLES = {
    f"{module.__name__}.{name}": table
    for module in (fp8_tuned, kda_tuned, mla_tuned, moe_tuned, norm_tuned)
    for name, table in vars(module).items()
    if name.isupper() and isinstance(table, dict)
}


def test_every_variant_is_reachable_by_name():
    for ops in OPS:
        for op, variants in ops.VARIANTS.items():
            for name, variant in variants.items():
                assert ops.kernel(op, name) is variant.kernel
                assert variant.platform in (None, "gpu", "tpu") and (variant.platform is None) == (name == "reference")


def test_unknown_variant_lists_the_known_ones():
    known = "reference, gpu_triton, tpu_mosaic, gpu_triton_any_gate, tpu_mosaic_any_gate, gpu_triton_short"
    with pytest.raises(ValueError, match=f"unknown variant 'gpu' of chunk_kda; known: {known}"):
        kda_ops.kernel("chunk_kda", "gpu")
    with pytest.raises(ValueError, match="unknown op 'chunk'; known: chunk_kda, kda_decode_step"):
        kda_ops.kernel("chunk", "reference")
    x = jnp.zeros((1, 3, 1, 16))
    with pytest.raises(ValueError, match="unknown variant 'triton' of mla_decode; known: reference, gpu_triton"):
        mla_ops.mla_decode(x[:, 0], x[:, 0], x[:, :, 0], jnp.ones((1,), jnp.int32), scale=1.0, variant="triton")


def test_the_default_path_never_imports_the_lab():
    """The model and every op load without `pallas_kernels.experimental`, whose modules register their variants
    when imported: the lab's variants exist only where a test or a benchmark imports them."""
    root = pathlib.Path(__file__).resolve().parents[2]
    code = "; ".join(
        [
            *(f"import pallas_kernels.{op}.ops" for op in ("fp8", "kda", "mla", "moe", "norm")),
            "import ling_jax.model",
            "import sys",
            "print(sorted(name for name in sys.modules if name.startswith('pallas_kernels.experimental')))",
        ]
    )
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    loaded = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout


def test_a_kernel_variant_needs_a_backend_of_its_platform():
    x, beta = jnp.zeros((1, 3, 1, 16)), jnp.zeros((1, 3, 1))
    with pytest.raises(ValueError, match="'tpu_mosaic' of chunk_kda is a tpu kernel: .* not 'interpret_gpu'"):
        chunk_kda(x, x, x, x, beta, backend="interpret_gpu", variant="tpu_mosaic")
    with pytest.raises(ValueError, match="'gpu_triton' of rms_norm is a gpu kernel: .* not 'reference'"):
        norm_ops.rms_norm(x, jnp.ones((16,)), 1e-6, backend="reference", variant="gpu_triton")


def test_a_variant_named_runs_that_variant():
    """The TPU kernel picked by name under the generic interpret backend equals the reference picked by name."""
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(1, 5, 2, 16)), jnp.float32) for _ in range(3))
    g = jnp.asarray(-r.uniform(size=(1, 5, 2, 16)), jnp.float32)
    beta, state = jnp.asarray(r.uniform(size=(1, 2)), jnp.float32), r.normal(size=(1, 2, 16, 16))
    args = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta)  # the kernel is given its own copy of the donated state
    ours = kda_decode_step(*args, jnp.asarray(state, jnp.float32), backend="interpret", variant="tpu_mosaic")
    ref = kda_decode_step(*args, jnp.asarray(state, jnp.float32), variant="reference")
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_table_has_a_default_and_cites_its_source(name):
    table = TABLES[name]
    assert (ANY, ANY, ANY) in table or any(key[0] == ANY for key in table), name
    for key, entry in table.items():
        assert isinstance(entry, Entry) and dataclasses.is_dataclass(entry.params), (name, key)
        assert len(entry.source) > 20, (name, key, entry.source)
    buckets = {key[1] for key in table} - {ANY} or {ANY}
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        for bucket in buckets:
            assert tuning.lookup(table, dtype=dtype, bucket=bucket, device="an unknown accelerator") is not None


def test_lookup_prefers_device_then_bucket_then_dtype():
    table = {
        (ANY, ANY, ANY): Entry("default", "-"),
        (ANY, ANY, "16bit"): Entry("16-bit", "-"),
        (ANY, "decode", ANY): Entry("decode", "-"),
        (H200, ANY, ANY): Entry("h200", "-"),
        (H200, ANY, "bfloat16"): Entry("h200 bf16", "-"),
    }
    assert tuning.lookup(table, dtype=jnp.float32, device="other") == "default"
    assert tuning.lookup(table, dtype=jnp.float16, device="other") == "16-bit"
    assert tuning.lookup(table, dtype=jnp.float16, bucket="decode", device="other") == "decode"
    assert tuning.lookup(table, dtype=jnp.float16, bucket="decode", device=H200) == "h200"
    assert tuning.lookup(table, dtype=jnp.bfloat16, bucket="decode", device=H200) == "h200 bf16"
    with pytest.raises(LookupError, match="no tuning entry"):
        tuning.lookup({(H200, ANY, ANY): Entry("h200", "-")}, dtype=jnp.float32, device="other")


def test_one_source_of_truth_for_the_kda_prefill_state_pass():
    """Phase 2 alone and inside the whole prefill take the same table entry (they once disagreed: 32 vs 64)."""
    assert tuning.lookup(kda_tuned.CHUNK_INTER, dtype=jnp.bfloat16, device=H200).block_v == 64
    assert tuning.lookup(kda_tuned.CHUNK_INTER, dtype=jnp.bfloat16, device="other") == tuning.lookup(
        kda_tuned.CHUNK_INTER, dtype=jnp.bfloat16, device=H200
    )
