"""Multi-host conversion, simulated by two threads sharing a filesystem and a barrier: each process writes only
the parameters it owns into its own OCDBT database, process 0 merges and publishes, and the result equals a
single-process conversion."""

from __future__ import annotations

import os
import threading

import jax
import numpy as np
from flax import nnx

from convert.pipeline import Cluster, Options, convert
from convert.plan import ParamPlan, model_parameters, owned_by
from convert.source import SourceTensor
from convert.synthetic import write_random_checkpoint
from ling_jax.checkpoints.orbax import load_checkpoint
from ling_jax.checkpoints.storage import PLAIN
from ling_jax.presets import preset


def test_two_processes_convert_what_they_own(tmp_path):
    config = preset("tiny")
    src = str(tmp_path / "hf")
    write_random_checkpoint(src, config, num_shards=3, mxfp4_experts=True)
    options = Options(dtype="fp8", workers=1, verify=True, progress=False)
    barrier = threading.Barrier(2, timeout=300)
    summaries, errors = {}, []

    def process(index: int) -> None:
        try:
            cluster = Cluster(index, 2, lambda name: barrier.wait())
            summaries[index] = convert(src, str(tmp_path / "two"), options, cluster)
        except BaseException as e:  # reported below; the other process must not hang at a barrier
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=process, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert summaries[0].converted and summaries[1].converted
    assert summaries[0].converted + summaries[1].converted == len(model_parameters(config))
    assert sorted(d for d in os.listdir(tmp_path / "two") if d.startswith("ocdbt.process_")) == [
        "ocdbt.process_0",
        "ocdbt.process_1",
    ]

    convert(src, str(tmp_path / "one"), options)
    two, one = load_checkpoint(tmp_path / "two"), load_checkpoint(tmp_path / "one")
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(two)), nnx.to_flat_state(nnx.state(one)), strict=True):
        for x, y in zip(
            jax.tree.leaves(a.get_value()), jax.tree.leaves(b.get_value()), strict=True
        ):  # FP8: values, scales
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


def test_ownership_is_a_balanced_partition():
    sizes = [900, 500, 400, 300, 300, 100, 50]
    plans = [
        ParamPlan(
            (f"p{i}",),
            (n,),
            np.dtype(np.float32),
            (SourceTensor(f"p{i}", "f", PLAIN, (n,), np.dtype(np.float32), n),),
            False,
            n,
        )
        for i, n in enumerate(sizes)
    ]
    parts = [owned_by(plans, i, 3) for i in range(3)]
    assert sorted(p.name for part in parts for p in part) == sorted(p.name for p in plans)
    loads = [sum(p.nbytes for p in part) for part in parts]
    assert max(loads) - min(loads) <= max(sizes) // 2
