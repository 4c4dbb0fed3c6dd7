"""The memory plan (`ling_jax.generation.memory_plan`, `scripts/memory_plan.py`): its exact parameter bytes against
a real model sharded on a mesh, the FP8 model against the published checkpoint size, the verdict, and the
flags refused in one line before anything compiles."""

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import REPO_ROOT

from ling_jax import LingForCausalLM
from ling_jax.config import DENSE, KDA, MLA, MOE
from ling_jax.generation.memory_plan import HARDWARE, Hardware, abstract_model, per_device_bytes, plan_memory
from ling_jax.presets import preset
from ling_jax.sharding import make_mesh, param_shardings, shard_model

MESH = {"expert": 2, "tensor": 2}


def _two_layer_tiny():
    """tiny with one KDA + dense and one MLA + MoE layer: both attention kinds, experts split over the mesh."""
    return preset("tiny").replace(
        num_hidden_layers=2, layer_types=(KDA, MLA), mlp_layer_types=(DENSE, MOE), vocab_size=256
    )


@pytest.fixture(scope="module")
def plan():
    return plan_memory(
        _two_layer_tiny(),
        MESH,
        HARDWARE["v5e"],
        batch=4,
        context=64,
        prefill_chunk=16,
        weights="bf16",
        kernel_backend="reference",
    )


def test_parameter_bytes_are_what_a_sharded_model_holds_per_device(plan):
    model = LingForCausalLM(_two_layer_tiny(), rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    mesh = make_mesh(MESH, jax.devices()[:4])
    shard_model(model, mesh)
    for device in mesh.devices.flat:
        held = sum(
            shard.data.nbytes
            for leaf in jax.tree.leaves(nnx.state(model))
            for shard in leaf.addressable_shards
            if shard.device == device
        )
        assert plan.param_bytes == held
    assert plan.devices == 4 and [name for name, _ in plan.steps[0].temps_by_kind] == ["kda+dense", "mla+moe"]
    assert all(step.temp_bytes > 0 for step in plan.steps)


def test_verdict_against_the_device_memory(plan):
    assert plan.fits and plan.verdict().startswith("fits")
    small = Hardware("small", plan.peak_bytes - 3 * 2**20, 1.0, "test")
    short = dataclasses.replace(plan, hardware=small)
    assert not short.fits
    assert short.verdict().startswith("does not fit by 3.00 MiB")
    assert "does not fit" in short.report()


def test_stored_ling_3_1_flash_is_the_published_checkpoint_size():
    """The FP8 model as the loaders' weights="stored" builds it, on one device: the published tensor bytes (the
    model keeps the same tensors, in the checkpoint's dtypes), within 0.1%."""
    state = nnx.state(abstract_model(preset("ling-3.1-flash"), weights="stored"))
    held = per_device_bytes(state, param_shardings(state, make_mesh({}, jax.devices()[:1])))
    assert held == pytest.approx(573_753_281_152, rel=1e-3)


def _cli():
    spec = importlib.util.spec_from_file_location("memory_plan_cli", REPO_ROOT / "scripts" / "memory_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--model", "tiny", "--mesh", "tensor=two", "--hardware", "v5e"], "--mesh"),
        (["--model", "tiny", "--mesh", "expert=3", "--hardware", "v5e"], "--mesh expert=3"),
        (["--model", "/no/such/checkpoint", "--hardware", "v5e"], "--model"),
        (["--model", "tiny", "--hardware", "v5e", "--context", "64", "--prefill-chunk", "128"], "--prefill-chunk"),
        (["--model", "tiny", "--hardware", "a100"], "--hardware"),
    ],
)
def test_bad_flags_fail_in_one_line(flags, named, capsys):
    with pytest.raises(SystemExit) as stop:
        _cli().main(flags)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err
