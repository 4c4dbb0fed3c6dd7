"""The Orbax side of a conversion: parameter arrays written slice by slice, then the directory made into the
checkpoint `ocp.StandardCheckpointer` (orbax-checkpoint 0.12.8) writes and restores.

Each process writes zarr arrays into its own OCDBT database `ocdbt.process_<i>` through orbax's own tensorstore
specs; `finalize` merges those into the root database and writes `_METADATA` and `_CHECKPOINT_METADATA`. The
chunk shape of every array is its conversion slice, so a slice write covers whole chunks and never reads
anything back, and arrays are uncompressed: weights hardly compress, and zstd would cost more CPU than
the disk saves.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from convert.plan import ParamPlan
from ling_jax.checkpoints.orbax import scale_name, scale_path

METADATA_FILE = "_METADATA"
CHECKPOINT_METADATA_FILE = "_CHECKPOINT_METADATA"
OCDBT_CACHE_BYTES = 16_000_000
_DICT_KEY = 2  # orbax's KeyType.DICT: NNX states are nested dicts (list indices included)
_HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"


def _context() -> ts.Context:
    """orbax's tensorstore context, but
    - without an fsync per write: with it every slice commit waits for the disk (0.26 GB/s here instead of
      1.7); `sync_to_disk` makes the result durable once, at the end;
    - with a 16 MB instead of 100 MB B-tree node cache: a conversion only appends, and the bigger cache was
      ~250 MB of the converter's RSS after 6 GB (the cache undercounts its nodes' memory)."""
    spec = ocp.type_handlers.get_ts_context(use_ocdbt=True).spec.to_json()
    return ts.Context(
        ts.Context.Spec({**spec, "file_io_sync": False, "cache_pool#ocdbt": {"total_bytes_limit": OCDBT_CACHE_BYTES}})
    )


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
        return os.path.join(self.directory, f"ocdbt.process_{self.process_index}")

    def _info(self, name: str) -> ocp.type_handlers.ParamInfo:
        return ocp.type_handlers.ParamInfo(
            name=name,
            parent_dir=epath.Path(self.directory),
            use_compression=False,
            is_ocdbt_checkpoint=True,
            ts_context=self.context,
        )

    def create(
        self, name: str, shape: tuple[int, ...], dtype: np.dtype, chunk_shape: tuple[int, ...]
    ) -> ts.TensorStore:
        """A new (or emptied) array in this process's database."""
        spec = ocp.type_handlers.get_json_tspec_write(
            self._info(name), True, shape, chunk_shape, dtype, process_index=self.process_index
        )
        spec["metadata"]["chunks"] = list(chunk_shape)
        return ts.open(spec, create=True, delete_existing=True, context=self.context).result()

    def create_param(self, plan: ParamPlan) -> tuple[ts.TensorStore, ts.TensorStore | None]:
        values = self.create(plan.name, plan.shape, plan.dtype, plan.slice_shape)
        if plan.scale_block is None:
            return values, None
        return values, self.create(
            scale_name(plan.name), plan.scale_shape, np.dtype(np.float32), plan.scale_slice_shape
        )

    def open_merged(self, name: str) -> ts.TensorStore:
        """An array of the merged root database (after `finalize`)."""
        spec = ocp.type_handlers.get_json_tspec_read(self._info(name), use_ocdbt=True)
        return ts.open(spec, open=True, read=True, context=self.context).result()


def _tree_entry(path: tuple, chunk_shape: tuple[int, ...]) -> tuple[str, dict]:
    keys = tuple(str(key) for key in path)
    return str(keys), {
        "key_metadata": [{"key": key, "key_type": _DICT_KEY} for key in keys],
        "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": list(chunk_shape)},
    }


def finalize(directory: str, plans: list[ParamPlan], context: ts.Context) -> None:
    """Merge the per-process databases into the root one and write orbax's PyTree and step metadata."""
    asyncio.run(ocp.type_handlers.merge_ocdbt_per_process_files(epath.Path(directory), context, use_zarr3=False))
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
