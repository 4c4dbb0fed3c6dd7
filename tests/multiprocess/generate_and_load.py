"""One process of test_multiprocess.py's job: `python generate_and_load.py HF_DIR ORBAX_DIR GENERATE_ARGS...`.

It runs generate.py's main with GENERATE_ARGS (which join the job: --distributed ...), then loads HF_DIR with
`load_hf_checkpoint` on an expert=4 mesh and ORBAX_DIR with `load_checkpoint` on a tensor=2 x expert=2 mesh, and
asserts that this process holds only its own devices' shards of each, and that it read from HF_DIR's safetensors
only the experts its own devices hold. Prints `own shards: ok` on stderr."""

from __future__ import annotations

import re
import sys

import jax
import jax.numpy as jnp
from shard_checks import assert_each_device_holds_its_fraction, leaves

from ling_jax import load_checkpoint, load_hf_checkpoint, make_mesh
from ling_jax.checkpoints.safetensors_io import SafetensorsFile
from ling_jax.generation.cli import main

EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def held_experts(model) -> set[int]:
    """The experts this process's devices hold of the first routed-expert array."""
    up = model.model.layers[1].mlp.experts.up_proj.get_value()
    up = getattr(up, "values", up)  # quantised: its FP8 values
    return {e for shard in up.addressable_shards for e in range(*shard.index[0].indices(up.shape[0])[:2])}


def assert_own_shards(model, mesh) -> None:
    """Each local device holds its fraction of every array, and some arrays are split between the processes."""
    assert_each_device_holds_its_fraction(model, mesh)
    assert any(not leaf.is_fully_addressable for leaf in leaves(model).values()), "no array is split between processes"


def run() -> int:
    hf_dir, orbax_dir, *generate_args = sys.argv[1:]
    status = main(generate_args)
    if status:
        return status

    experts_read = set()
    read = SafetensorsFile.read

    def recording_read(self, name, index=(), out=None):
        if match := EXPERT.search(name):
            experts_read.add(int(match.group(1)))
        return read(self, name, index, out)

    SafetensorsFile.read = recording_read
    mesh = make_mesh({"expert": 4})
    from_hf = load_hf_checkpoint(hf_dir, mesh=mesh, dtype=jnp.float32, progress=False)
    assert_own_shards(from_hf, mesh)
    held = held_experts(from_hf)
    assert len(held) == 16 // jax.process_count() and experts_read == held, (experts_read, held)

    mesh = make_mesh({"tensor": 2, "expert": 2})
    assert_own_shards(load_checkpoint(orbax_dir, mesh=mesh), mesh)
    print("own shards: ok", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run())
