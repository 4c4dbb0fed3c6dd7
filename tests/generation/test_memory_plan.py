"""The memory plan (`ling_jax.generation.memory_plan`, `scripts/memory_plan.py`): its exact parameter bytes against
a real model sharded on a mesh, the FP8 model against the checkpoint's bytes by arithmetic, the verdict, and the
flags refused in one line before anything compiles."""

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import pytest
from checkpoint_bytes import checkpoint_bytes
from flax import nnx
from helpers import REPO_ROOT

from ling_jax import LingForCausalLM
from ling_jax.config import DENSE, KDA, MLA, MOE
from ling_jax.generation.memory_plan import HARDWARE, Hardware, abstract_model, per_device_bytes, plan_memory
from ling_jax.presets import preset
from ling_jax.sharding import make_mesh, param_shardings

MESH = {"expert": 2, "tensor": 2}


def _one_layer_tiny():
    """tiny with one MLA + MoE layer (and its MTP layer): experts split over the mesh, one kind to compile."""
    return preset("tiny").replace(num_hidden_layers=1, layer_types=(MLA,), mlp_layer_types=(MOE,), vocab_size=256)


@pytest.fixture(scope="module")
def plan():
    return plan_memory(
        _one_layer_tiny(),
        MESH,
        HARDWARE["v5e"],
        batch=4,
        context=64,
        prefill_chunk=16,
        weights="bf16",
        kernel_backend="reference",
    )


def test_parameter_bytes_are_what_a_sharded_model_holds_per_device(plan):
    mesh = make_mesh(MESH, jax.devices()[:4])

    def build():
        return nnx.state(LingForCausalLM(_one_layer_tiny(), rngs=nnx.Rngs(0), dtype=jnp.bfloat16))

    state = jax.jit(build, out_shardings=param_shardings(nnx.eval_shape(build), mesh))()  # real arrays, sharded
    for device in mesh.devices.flat:
        held = sum(
            shard.data.nbytes
            for leaf in jax.tree.leaves(state)
            for shard in leaf.addressable_shards
            if shard.device == device
        )
        assert plan.param_bytes == held
    assert plan.devices == 4 and [name for name, _ in plan.steps[0].temps_by_kind] == ["mla+moe"]
    assert all(step.temp_bytes > 0 for step in plan.steps)


def test_verdict_against_the_device_memory(plan):
    assert plan.fits and plan.verdict().startswith("fits")
    small = Hardware("small", plan.peak_bytes - 3 * 2**20, 1.0, "test")
    short = dataclasses.replace(plan, hardware=small)
    assert not short.fits
    assert short.verdict().startswith("does not fit by 3.00 MiB")
    assert "does not fit" in short.report()


def test_stored_model_holds_the_checkpoint_bytes():
    """The FP8 model as the loaders' weights="stored" build it, on one device, at Ling-3.1-flash width (its dense
    and MoE layer kinds and the MTP layer): the checkpoint's tensor bytes by plain arithmetic, to the byte."""
    full = preset("ling-3.1-flash")
    config = full.replace(num_hidden_layers=2, layer_types=(KDA, MLA), mlp_layer_types=(DENSE, MOE))
    state = nnx.state(abstract_model(config, weights="stored"))
    assert per_device_bytes(state, param_shardings(state, make_mesh({}, jax.devices()[:1]))) == checkpoint_bytes(config)


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
