"""The conversion: DST and SRC checked (`destination`, `inputs`) -> plan (every source tensor inspected) -> each
slice read, transformed by a hook, refused if it holds NaN / Inf, and written, on a thread pool -> per-process
databases merged, metadata written -> optional verification -> the finished directory renamed to DST.

Multi-host: under `jax.distributed` every process converts only the parameters it owns (`plan.owned_by`) into its
own OCDBT database inside the shared workspace; process 0 merges them, writes the metadata and publishes DST
between barriers. The workspace must be on a filesystem all processes share. The checks before any tensor is
converted, and the workspace's creation and attachment, are stages every process agrees on
(`ling_jax.distributed.agreement`): SRC missing on one process, a workspace another process cannot see or a
different command stop every process with an error instead of leaving them waiting at a barrier.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager

import jax
import numpy as np
import orbax.checkpoint as ocp

from convert import BF16, ConvertError
from convert.destination import SIDE_FILES, check_apart, check_destination
from convert.inputs import open_source
from convert.plan import COMPUTE_DTYPE, ParamPlan, Slice, build_plan, owned_by
from convert.slices import over_slices, slice_values
from convert.source import ShardReader
from convert.store import ArrayStore, finalize, sync_to_disk
from convert.verify import verify_params
from convert.workspace import Journal, Workspace
from ling_jax import distributed
from ling_jax.build import text_config_of
from ling_jax.checkpoints.finite_check import NonFiniteError, check_finite
from ling_jax.checkpoints.hf import TensorResolver
from ling_jax.checkpoints.orbax import StoredLayout


@dataclasses.dataclass(frozen=True)
class Options:
    dtype: str = BF16
    workers: int = 2
    resume: bool = False
    verify: bool = False
    overwrite: bool = False
    progress: bool = True
    allow_nonfinite: bool = False  # publish tensors holding NaN / Inf instead of refusing them
    mesh: dict[str, int] | None = None  # target mesh axis sizes: chunks aligned to its shards, recorded in the layout


def _no_barrier(name: str) -> None:
    del name


@contextlib.contextmanager
def _then_barrier(barrier: Callable[[str], None], stage: str) -> Iterator[None]:
    yield
    barrier(stage)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The processes converting together, and how they wait for each other."""

    process_index: int = 0
    process_count: int = 1
    barrier: Callable[[str], None] = _no_barrier
    timeout_s: int | None = None  # under jax.distributed: how long a stage waits for the other processes

    @classmethod
    def jax_distributed(cls, timeout_s: int) -> Cluster:
        """The job this process joined (`ling_jax.distributed.join`)."""
        return cls(jax.process_index(), jax.process_count(), ocp.multihost.sync_global_processes, timeout_s)

    @property
    def primary(self) -> bool:
        return self.process_index == 0

    def stage(self, name: str, job: Mapping[str, object]) -> AbstractContextManager:
        """Run a stage's body on every process, then wait for all of them; under jax.distributed an error or a
        different `job` on any process stops every process (`ling_jax.distributed.agreement`)."""
        if self.timeout_s is None:
            return _then_barrier(self.barrier, name)
        return distributed.agreement(name, job, self.timeout_s)


@dataclasses.dataclass(frozen=True)
class Summary:
    converted: int  # parameters written by this run
    resumed: int  # parameters an earlier, killed run had finished
    bytes_read: int
    seconds: float  # writing only
    verified: bool


def _check_finite(value: np.ndarray, name: str, file: str, piece: Slice) -> None:
    """Refuse converted rows holding NaN or Inf (dense: after dequantisation; FP8: the codes or their scales)."""
    try:
        check_finite(value, name)
    except NonFiniteError as e:
        raise ConvertError(
            f"{file}: tensor '{name}' has {e.count} NaN or Inf values in rows "
            f"{piece.start}..{piece.stop} (--allow-nonfinite converts it anyway)"
        ) from e


def _write_params(
    plans: list[ParamPlan], reader: ShardReader, store: ArrayStore, journal: Journal, options: Options
) -> None:
    """Convert `plans` slice by slice; a parameter goes into the journal once all its slices are written."""
    arrays: dict[str, tuple] = {}
    slices_left = {plan.name: sum(1 for _ in plan.slices()) for plan in plans}
    lock = threading.Lock()

    def param_arrays(plan: ParamPlan) -> tuple:
        with lock:
            if plan.name not in arrays:
                arrays[plan.name] = store.create_param(plan)
            return arrays[plan.name]

    def convert_slice(item: tuple[ParamPlan, Slice]) -> int:
        plan, piece = item
        values_array, scale_array = param_arrays(plan)
        derived = slice_values(plan, piece, reader)
        writes = [(values_array[plan.index(piece)], derived.values, derived.source.name)]
        if scale_array is not None:
            writes.append((scale_array[plan.scale_index(piece)], derived.scale, derived.source.scale))
        if not options.allow_nonfinite:
            for _, value, name in writes:
                _check_finite(value, name, derived.source.file, piece)
        for target, value, _ in writes:
            target.write(value.reshape(target.shape)).result()
        return derived.nbytes

    def finished(item: tuple[ParamPlan, Slice], nbytes: int) -> None:
        plan = item[0]
        slices_left[plan.name] -= 1
        if not slices_left[plan.name]:
            journal.record(plan.name)
            with lock:
                del arrays[plan.name]

    over_slices(plans, convert_slice, options.workers, desc="converting", progress=options.progress, on_done=finished)


def copy_side_files(src: str, dst: str) -> None:
    for entry in sorted(os.listdir(src)):
        path = os.path.join(src, entry)
        if os.path.isfile(path) and any(fnmatch.fnmatch(entry, pattern) for pattern in SIDE_FILES):
            shutil.copy2(path, os.path.join(dst, entry))


def convert(src: str, dst: str, options: Options = Options(), cluster: Cluster = Cluster()) -> Summary:
    """Convert the HF checkpoint directory `src` into the Orbax checkpoint `dst` (see the module docstring)."""
    named_dst = os.path.abspath(dst)
    src, dst = os.path.realpath(src), os.path.realpath(dst)
    job = {"source": src, "dtype": options.dtype, "process_count": cluster.process_count}
    command = {**job, "destination": dst, "mesh": options.mesh, "resume": options.resume, "verify": options.verify}
    with cluster.stage("ling-convert:checked", command):
        workspace = Workspace(dst)
        if os.path.exists(src) and not os.path.isdir(src):
            raise ConvertError(f"{src}: is a file; the source is a checkpoint directory (config.json, safetensors)")
        if not os.path.isdir(src):
            raise ConvertError(f"{src}: source checkpoint directory not found")
        check_apart(src, dst, workspace.path, named_dst)
        check_destination(dst, options.overwrite)
        config, tensors = open_source(src)
        plans = build_plan(TensorResolver(tensors, text_config_of(config)), config, options.dtype, options.mesh)
        mine = owned_by(plans, cluster.process_index, cluster.process_count)
        if cluster.primary:
            workspace.prepare(job, resume=options.resume, overwrite=options.overwrite)
    with cluster.stage("ling-convert:workspace", command):
        if not cluster.primary:  # the workspace must be on a filesystem every process shares
            workspace.attach(job)
    journal = workspace.journal(cluster.process_index)
    done = journal.finished() if options.resume else set()
    todo = [plan for plan in mine if plan.name not in done]

    store = ArrayStore(workspace.path, cluster.process_index)
    with ShardReader(tensors) as reader:
        start = time.perf_counter()
        try:
            _write_params(todo, reader, store, journal, options)
        except ConvertError as e:
            raise ConvertError(
                f"{e}; nothing was published at {dst} (the parameters finished so far are kept in "
                f"{workspace.path} for --resume)"
            ) from e
        seconds = time.perf_counter() - start
        _assemble(workspace.path, plans, src, store, cluster, options.mesh)
        if options.verify:
            try:
                verify_params(mine, reader, store, options.workers, options.progress, options.allow_nonfinite)
            except ConvertError as e:
                raise ConvertError(
                    f"{e} (verification failed: nothing was published at {dst}; the unverified "
                    f"conversion is in {workspace.path})"
                ) from e
    cluster.barrier("ling-convert:verified")
    if cluster.primary:
        workspace.publish(options.overwrite)
    cluster.barrier("ling-convert:published")
    return Summary(len(todo), len(mine) - len(todo), sum(plan.nbytes for plan in todo), seconds, options.verify)


def _assemble(
    directory: str, plans: list[ParamPlan], src: str, store: ArrayStore, cluster: Cluster, mesh: dict[str, int] | None
) -> None:
    """Make every process's arrays durable, then (process 0) merge them into an Orbax checkpoint beside
    `ling_convert.json` and SRC's config and tokenizer files."""
    if os.path.isdir(store.database_directory):
        sync_to_disk(store.database_directory)
    cluster.barrier("ling-convert:written")
    if cluster.primary:
        finalize(directory, plans, store.context)
        StoredLayout(COMPUTE_DTYPE.name, {p.name: p.scale_block for p in plans if p.scale_block}, mesh).write(directory)
        copy_side_files(src, directory)
        sync_to_disk(directory)
    cluster.barrier("ling-convert:finalized")
