"""Decode-cache budget (ling_jax/generation/memory.py, scripts/memory_budget.py): the spec's seed figures
(§2, §3.4), and the caches `cache.py` really allocates hold exactly the absorbed size, leaf by leaf."""

import importlib.util
import json
import os
import subprocess
import sys
from fractions import Fraction

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import REPO_ROOT

from ling_jax import LingConfig, LingForCausalLM
from ling_jax.cache import KDAState, LingCache, MLAState, MTPCache
from ling_jax.generation.memory import cache_budget, cache_bytes, format_bytes
from ling_jax.presets import TINY, preset

MiB = 2**20
REPO = str(REPO_ROOT)
SCRIPT = os.path.join(REPO, "scripts", "memory_budget.py")


# ------------------------------------------------------------------------------------------ seed figures
def test_ling_3_1_flash_seed_figures():
    context = 262144
    b = cache_budget(preset("ling-3.1-flash"), 1, context)
    assert (b.kda_layers, b.mla_layers, b.mtp_layers, b.dtype) == (63, 9, 1, "bfloat16")
    assert b.kda_state_bytes == 63 * 64 * 128 * 128 * 4 == 252 * MiB
    assert b.kda_conv_bytes == 63 * 3 * (3 * 8192) * 2
    assert b.latent_values_per_token == 576
    assert b.absorbed_mla_bytes == 9 * context * 1152
    assert b.expanded_values_per_token == 64 * (192 + 128) == 20480
    assert b.expanded_mla_bytes == 9 * context * 20480 * 2
    assert b.mtp_bytes == context * 1152
    assert b.lengths_bytes == 4
    assert b.total_bytes == 252 * MiB + 63 * 3 * 8192 * 3 * 2 + 9 * context * 1152 + 4
    assert b.expanded_over_absorbed == float(Fraction(20480, 576)) == pytest.approx(35.5556, abs=1e-4)
    assert b.expanded_mla_bytes / b.absorbed_mla_bytes == b.expanded_over_absorbed


def test_ling_3_0_flash_seed_figures():
    context = 4096
    b = cache_budget(preset("ling-3.0-flash"), 1, context)
    assert (b.kda_layers, b.mla_layers, b.mtp_layers) == (35, 7, 1)
    assert b.kda_state_bytes == 35 * 32 * 128 * 128 * 4 == 70 * MiB
    assert b.kda_conv_bytes == 35 * 3 * (3 * 4096) * 2
    assert b.absorbed_mla_bytes == 7 * context * 576 * 2
    assert b.expanded_values_per_token == 32 * 320 == 10240
    assert b.expanded_mla_bytes == 7 * context * 10240 * 2
    assert b.expanded_over_absorbed == float(Fraction(10240, 576))


def test_budget_is_linear_in_batch_and_state_stays_fp32():
    config = preset("ling-3.1-flash")
    one = cache_budget(config, 1, 1000)
    four = cache_budget(config, 4, 1000)
    for field in (
        "kda_state_bytes",
        "kda_conv_bytes",
        "absorbed_mla_bytes",
        "expanded_mla_bytes",
        "mtp_bytes",
        "lengths_bytes",
    ):
        assert getattr(four, field) == 4 * getattr(one, field), field
    assert four.total_bytes == 4 * one.total_bytes
    f32 = cache_budget(config, 1, 1000, "float32")
    assert f32.dtype == "float32"
    assert f32.kda_state_bytes == one.kda_state_bytes
    assert f32.kda_conv_bytes == 2 * one.kda_conv_bytes and f32.absorbed_mla_bytes == 2 * one.absorbed_mla_bytes
    assert cache_budget(config, 1, 2000).absorbed_mla_bytes == 2 * one.absorbed_mla_bytes
    assert cache_budget(config, 1, 2000).kda_state_bytes == one.kda_state_bytes


def test_mtp_excluded_from_total_and_zero_without_mtp_layer():
    config = preset("tiny")
    b = cache_budget(config, 2, 64)
    assert b.total_with_mtp_bytes == b.total_bytes + b.mtp_bytes + b.lengths_bytes
    none = cache_budget(config.replace(num_nextn_predict_layers=0), 2, 64)
    assert (none.mtp_layers, none.mtp_bytes, none.mtp_cache_bytes) == (0, 0, 0)
    assert none.total_with_mtp_bytes == none.total_bytes == b.total_bytes


@pytest.mark.parametrize("batch, context", [(0, 10), (1, 0), (-1, 10), (1, 2.5), (True, 10)])
def test_bad_sizes_raise(batch, context):
    with pytest.raises(ValueError, match="positive int"):
        cache_budget(preset("tiny"), batch, context)


# ------------------------------------------------------------------------------- allocated caches
def _check_leaves(cache: LingCache, config: LingConfig, batch: int, length: int, dtype) -> None:
    """Every leaf has the documented shape and dtype, and there are no others."""
    c = config
    expected = 1  # lengths
    assert cache.lengths.shape == (batch,) and cache.lengths.dtype == jnp.int32
    for kind, state in zip(c.layer_types, cache.layers, strict=True):
        if kind == "kda":
            assert isinstance(state, KDAState)
            assert state.recurrent_state.shape == (batch, c.num_attention_heads, c.head_dim, c.head_dim)
            assert state.recurrent_state.dtype == jnp.float32
            assert state.conv_window.shape == (batch, c.short_conv_kernel_size - 1, 3 * c.kda_dim)
            assert state.conv_window.dtype == dtype
            expected += 2
        else:
            assert isinstance(state, MLAState)
            assert state.latent.shape == (batch, length, c.latent_dim) and state.latent.dtype == dtype
            expected += 1
    assert len(jax.tree.leaves(cache)) == expected


def test_abstract_ling_3_1_flash_cache_is_exactly_absorbed_size():
    config = preset("ling-3.1-flash")
    batch, length = 2, 262144
    cache = jax.eval_shape(lambda: LingCache.create(config, batch, length, jnp.bfloat16))
    _check_leaves(cache, config, batch, length, jnp.bfloat16)
    assert config.latent_dim == 576
    b = cache_budget(config, batch, length, jnp.bfloat16)
    assert cache_bytes(cache) == b.kda_state_bytes + b.kda_conv_bytes + b.absorbed_mla_bytes + batch * 4
    assert cache_bytes(cache) == b.total_bytes
    mtp = jax.eval_shape(lambda: MTPCache.create(config, batch, length, jnp.bfloat16))
    assert mtp.layer.latent.shape == (batch, length, 576)
    assert cache_bytes(mtp) == b.mtp_bytes + batch * 4 == b.mtp_cache_bytes


def test_allocated_tiny_cache_is_exactly_absorbed_size():
    config = preset("tiny")
    batch, length = 3, 40
    model = LingForCausalLM(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    for dtype in (None, jnp.float32):  # None: the model's activation dtype
        cache = model.init_cache(batch, length, dtype)
        dtype = dtype or jnp.bfloat16
        _check_leaves(cache, config, batch, length, dtype)
        b = cache_budget(config, batch, length, dtype)
        assert cache_bytes(cache) == sum(leaf.nbytes for leaf in jax.tree.leaves(cache))
        assert cache_bytes(cache) == b.kda_state_bytes + b.kda_conv_bytes + b.absorbed_mla_bytes + batch * 4
        mtp = model.init_mtp_cache(batch, length, dtype)
        assert cache_bytes(mtp) == sum(leaf.nbytes for leaf in jax.tree.leaves(mtp)) == b.mtp_cache_bytes


def test_cache_bytes_rejects_non_array_leaves():
    with pytest.raises(TypeError, match="shape/dtype"):
        cache_bytes({"a": jnp.zeros(3), "b": 7})


# ------------------------------------------------------------------------------------------ table / CLI
def test_format_bytes():
    assert [format_bytes(n) for n in (0, 1023, 1024, 252 * MiB, 90 * 2**30, 2**20 - 1)] == [
        "0 B",
        "1023 B",
        "1.00 KiB",
        "252.00 MiB",
        "90.00 GiB",
        "1.00 MiB",
    ]


def test_table_reports_seed_figures():
    table = cache_budget(preset("ling-3.1-flash"), 2, 262144).table()
    kda_row = next(line for line in table.splitlines() if line.startswith("KDA recurrent state"))
    assert kda_row.split()[-4:] == ["252.00", "MiB", "504.00", "MiB"]
    assert "35.56x" in table and "absorbed 576 (1152 B)" in table and "expanded 20480" in table


def _run_cli(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=60, cwd="/")


def test_cli_prints_budget():
    result = _run_cli("--preset", "ling-3.1-flash", "--batch", "1", "--context", "262144")
    assert result.returncode == 0, result.stderr
    assert "252.00 MiB" in result.stdout and "35.56x" in result.stdout
    assert "MTP latent cache" in result.stdout and "288.00 MiB" in result.stdout


def test_cli_bad_arg_exits_nonzero():
    result = _run_cli("--batch", "0")
    assert result.returncode == 2
    assert "--batch: must be positive" in result.stderr and result.stdout == ""


@pytest.fixture(scope="module")
def cli():
    spec = importlib.util.spec_from_file_location("memory_budget_cli", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "args, message",
    [
        (("--context", "-5"), "--context: must be positive"),
        (("--context", "lots"), "--context: expected a positive integer"),
        (("--preset", "ling-9"), "invalid choice: 'ling-9'"),
        (("--config", "/nonexistent/ling"), "--config: no config.json"),
        (("--preset", "tiny", "--config", "x"), "not allowed with argument"),
        (("--dtype", "int8"), "invalid choice: 'int8'"),
    ],
)
def test_cli_rejects_bad_args(cli, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(list(args))
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_reads_config_file(cli, capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert cli.main(["--config", str(tmp_path), "--batch", "2", "--context", "8192"]) == 0
    out = capsys.readouterr().out
    assert f"config: {tmp_path}" in out and "NOTE: context 8,192 exceeds" in out and "4.00x" in out
