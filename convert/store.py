"""The Orbax side of a conversion: parameter arrays written slice by slice, then the directory made into the
checkpoint `ocp.StandardCheckpointer` writes and restores (orbax-checkpoint 0.12.8's layout, which 0.11.20 to
0.12.8 restore alike).

Each process writes zarr (v2) arrays into its own OCDBT database `ocdbt.process_<i>`; `finalize` merges those
into the root database and writes `_METADATA` and `_CHECKPOINT_METADATA`. The tensorstore specs are the ones
orbax-checkpoint 0.12.8 builds, written out here as JSON (tensorstore >= 0.1.84 reads them): orbax's spec
builders are internal and changed across its releases (0.12.0's write spec lacks the dtype). The chunk shape of
every array is its conversion slice, so a slice write covers whole chunks and never reads anything back, and
arrays are uncompressed: weights hardly compress, and zstd would cost more CPU than the disk saves.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import time

import numpy as np
import tensorstore as ts

from convert.plan import ParamPlan
from ling_jax.checkpoints.orbax import scale_name, scale_path

METADATA_FILE = "_METADATA"
CHECKPOINT_METADATA_FILE = "_CHECKPOINT_METADATA"
OCDBT_CACHE_BYTES = 16_000_000
OCDBT_DATA_FILE_BYTES = 2**31  # orbax's target size of one OCDBT data file on a local disk
_PROCESS_DATABASE = "ocdbt.process_{}"
_DICT_KEY = 2  # orbax's KeyType.DICT: NNX states are nested dicts (list indices included)
_HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"


def _context() -> ts.Context:
    """orbax's tensorstore context (128 concurrent file operations, a named cache for OCDBT B-tree nodes), but
    - without an fsync per write: with it every slice commit waits for the disk (0.26 GB/s here instead of
      1.7); `sync_to_disk` makes the result durable once, at the end;
    - with a 16 MB instead of 100 MB B-tree node cache: a conversion only appends, and the bigger cache was
      ~250 MB of the converter's RSS after 6 GB (the cache undercounts its nodes' memory)."""
    return ts.Context(
        {
            "file_io_concurrency": {"limit": 128},
            "file_io_sync": False,
            "cache_pool#ocdbt": {"total_bytes_limit": OCDBT_CACHE_BYTES},
        }
    )


def _database(directory: str, *, write: bool) -> dict:
    """The OCDBT key-value store in `directory` as orbax opens it: data files written in place (no rename each),
    the manifest atomically; when writing, one single-file manifest and small values (zarr metadata) inline."""
    spec = {
        "driver": "ocdbt",
        "base": {"driver": "file", "path": directory + "/", "file_io_locking": {"mode": "non_atomic"}},
        "manifest": {"driver": "file", "path": directory + "/"},
        "cache_pool": "cache_pool#ocdbt",
    }
    if write:
        spec["target_data_file_size"] = OCDBT_DATA_FILE_BYTES
        spec["config"] = {
            "max_inline_value_bytes": 1024,
            "max_decoded_node_bytes": 100_000_000,
            "manifest_kind": "single",
        }
        spec["assume_config"] = True  # no initial empty manifest: nothing else writes to this database
    return spec


def sync_to_disk(directory: str) -> None:
    """fsync every file and directory under `directory`."""
    for parent, _, files in os.walk(directory):
        for entry in [*files, "."]:
            fd = os.open(os.path.join(parent, entry), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class ArrayStore:
    """Creates, writes and reads back the parameter arrays of the checkpoint being built in `directory`."""

    def __init__(self, directory: str, process_index: int):
        self.directory = directory
        self.process_index = process_index
        self.context = _context()

    @property
    def database_directory(self) -> str:
        """This process's OCDBT database (orbax's per-process layout)."""
        return os.path.join(self.directory, _PROCESS_DATABASE.format(self.process_index))

    def create(
        self, name: str, shape: tuple[int, ...], dtype: np.dtype, chunk_shape: tuple[int, ...]
    ) -> ts.TensorStore:
        """A new (or emptied) array in this process's database."""
        spec = {
            "driver": "zarr",
            "kvstore": {**_database(self.database_directory, write=True), "path": name},
            "recheck_cached_data": False,
            "recheck_cached_metadata": False,
            "store_data_equal_to_fill_value": True,  # zero chunks too: restores refuse a missing chunk
            "metadata": {"shape": list(shape), "chunks": list(chunk_shape), "compressor": None},
            "dtype": np.dtype(dtype).name,
        }
        return ts.open(spec, create=True, delete_existing=True, context=self.context).result()

    def create_param(self, plan: ParamPlan) -> tuple[ts.TensorStore, ts.TensorStore | None]:
        values = self.create(plan.name, plan.shape, plan.dtype, plan.slice_shape)
        if plan.scale_block is None:
            return values, None
        return values, self.create(
            scale_name(plan.name), plan.scale_shape, np.dtype(np.float32), plan.scale_slice_shape
        )

    def open_merged(self, name: str) -> ts.TensorStore:
        """An array of the merged root database (after `finalize`); a chunk never written is an error."""
        spec = {
            "driver": "zarr",
            "kvstore": {**_database(self.directory, write=False), "path": name},
            "recheck_cached_data": False,
            "recheck_cached_metadata": False,
            "fill_missing_data_reads": False,
        }
        return ts.open(spec, open=True, read=True, context=self.context).result()


def _tree_entry(path: tuple, chunk_shape: tuple[int, ...]) -> tuple[str, dict]:
    keys = tuple(str(key) for key in path)
    return str(keys), {
        "key_metadata": [{"key": key, "key_type": _DICT_KEY} for key in keys],
        "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": list(chunk_shape)},
    }


async def _merge_databases(directory: str, context: ts.Context) -> None:
    """Copy every process's database into the root one, in one atomic commit: orbax's merge, whose root
    database keeps pointing into the per-process data files."""
    processes = sorted(glob.glob(os.path.join(directory, _PROCESS_DATABASE.format("*"))))
    opened = await asyncio.gather(
        ts.KvStore.open(_database(directory, write=True), context=context),
        *(ts.KvStore.open(_database(process, write=False), context=context) for process in processes),
    )
    root, transaction = opened[0], ts.Transaction(atomic=True)
    await asyncio.gather(
        *(process.experimental_copy_range_to(root.with_transaction(transaction)) for process in opened[1:])
    )
    await transaction.commit_async()


def finalize(directory: str, plans: list[ParamPlan], context: ts.Context) -> None:
    """Merge the per-process databases into the root one and write orbax's PyTree and step metadata."""
    asyncio.run(_merge_databases(directory, context))
    tree = {}
    for plan in plans:
        key, entry = _tree_entry(plan.path, plan.slice_shape)
        tree[key] = entry
        if plan.scale_block is not None:
            key, entry = _tree_entry(scale_path(plan.path), plan.scale_slice_shape)
            tree[key] = entry
    metadata = {
        "tree_metadata": tree,
        "use_ocdbt": True,
        "use_zarr3": False,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": None,
    }
    with open(os.path.join(directory, METADATA_FILE), "w") as f:
        json.dump(metadata, f)
    now = time.time_ns()
    step = {
        "item_handlers": _HANDLER,
        "metrics": {},
        "performance_metrics": {},
        "init_timestamp_nsecs": now,
        "commit_timestamp_nsecs": now,
        "custom_metadata": {},
    }
    with open(os.path.join(directory, CHECKPOINT_METADATA_FILE), "w") as f:
        json.dump(step, f)
