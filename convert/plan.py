"""The conversion plan: one entry per NNX parameter of the model config.json describes, with the checkpoint
tensors that fill it (`ling_jax.checkpoints.names.source_for`), its stored dtype and the row slices it is
converted in. Building the plan inspects every source tensor, so a broken checkpoint fails here, before
anything is written. With a target mesh (`--mesh`), each parameter's row slices (the stored chunks) are cut to
divide the rows every device will hold, so a sharded restore reads whole chunks; a mesh that does not fit the
model is refused here too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from convert import BF16, FP8_KEPT
from convert.hooks import FP8_CODE_DTYPE
from convert.source import SourceTensor, inspect_source
from ling_jax.build import abstract_model, text_config_of
from ling_jax.checkpoints.hf import TensorResolver
from ling_jax.checkpoints.names import source_for
from ling_jax.checkpoints.orbax import param_name
from ling_jax.checkpoints.storage import FP8, PLAIN
from ling_jax.config import LingConfig
from ling_jax.sharding import logical_to_spec
from ling_jax.vl.config import LingVLConfig

COMPUTE_DTYPE = np.dtype(jnp.bfloat16)
SLICE_ELEMENTS = 1 << 23  # rows are converted ~8M elements at a time (rounded to whole scale blocks)


@dataclasses.dataclass(frozen=True)
class Slice:
    expert: int | None  # index into a stacked parameter's sources; None when not stacked
    start: int  # rows of the source tensor
    stop: int


@dataclasses.dataclass(frozen=True)
class ParamPlan:
    path: tuple  # NNX flat-state path
    shape: tuple[int, ...]  # parameter shape ([E, ...] when stacked)
    dtype: np.dtype  # stored dtype
    sources: tuple[SourceTensor, ...]  # one tensor, or one per expert stacked along axis 0
    stacked: bool
    rows_per_slice: int
    scale_block: tuple[int, int] | None = None  # stored quantised: FP8 values plus `<name>_scale_inv`

    @property
    def name(self) -> str:
        return param_name(self.path)

    @property
    def nbytes(self) -> int:
        """Bytes read from the checkpoint."""
        return sum(source.nbytes for source in self.sources)

    @property
    def _rows(self) -> int:
        return self.sources[0].shape[0]

    def slices(self) -> Iterator[Slice]:
        experts = range(len(self.sources)) if self.stacked else [None]
        for expert in experts:
            for start in range(0, self._rows, self.rows_per_slice):
                yield Slice(expert, start, min(start + self.rows_per_slice, self._rows))

    def _lead(self, expert: int | None) -> tuple:
        return () if expert is None else (expert,)

    @property
    def slice_shape(self) -> tuple[int, ...]:
        """The chunk shape: one full slice (a slice is reshaped from its source's layout to this)."""
        trailing = self.shape[2:] if self.stacked else self.shape[1:]
        return (*((1,) if self.stacked else ()), self.rows_per_slice, *trailing)

    def index(self, piece: Slice) -> tuple:
        return (*self._lead(piece.expert), slice(piece.start, piece.stop))

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return (*self.shape[:-2], *self._scale_rows_cols(self.shape[-2], self.shape[-1]))

    @property
    def scale_slice_shape(self) -> tuple[int, ...]:
        return (*((1,) if self.stacked else ()), *self._scale_rows_cols(self.rows_per_slice, self.shape[-1]))

    def scale_index(self, piece: Slice) -> tuple:
        block_rows = self.scale_block[0]
        return (*self._lead(piece.expert), slice(piece.start // block_rows, -(-piece.stop // block_rows)))

    def _scale_rows_cols(self, rows: int, cols: int) -> tuple[int, int]:
        block_rows, block_cols = self.scale_block
        return -(-rows // block_rows), -(-cols // block_cols)


def _rows_per_slice(sources: tuple[SourceTensor, ...], shard_rows: int) -> int:
    """~SLICE_ELEMENTS per slice, whole scale blocks, and (when possible) a divisor of the rows of one shard."""
    shape = sources[0].shape
    align = max(source.row_align for source in sources)
    row_elements = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    rows = min(max(align, SLICE_ELEMENTS // row_elements // align * align), shape[0])
    if shard_rows % rows == 0:
        return rows
    fitting = [r for r in range(rows - rows % align, 0, -align) if shard_rows % r == 0]
    return fitting[0] if fitting else rows


def _quantised_block(sources: tuple[SourceTensor, ...]) -> tuple[int, int] | None:
    """The common scale block when every source is quantised the same way (so they share one scale array)."""
    first = sources[0]
    same = all((s.kind, s.dtype, s.block) == (first.kind, first.dtype, first.block) for s in sources)
    return first.block if same and first.kind != PLAIN else None


def _param_plan(
    path: tuple,
    shape: tuple[int, ...],
    dtype: np.dtype,
    sources: tuple[SourceTensor, ...],
    stacked: bool,
    mode: str,
    shard_rows: int,
) -> ParamPlan:
    rows = _rows_per_slice(sources, shard_rows)
    block = _quantised_block(sources) if mode == FP8_KEPT else None
    if block is None:
        return ParamPlan(path, shape, dtype, sources, stacked, rows)
    stored = sources[0].dtype if sources[0].kind == FP8 else FP8_CODE_DTYPE  # MXFP4 becomes E4M3 codes
    return ParamPlan(path, shape, stored, sources, stacked, rows, block)


def model_parameters(config: LingConfig | LingVLConfig) -> list[tuple[tuple, jax.ShapeDtypeStruct, tuple]]:
    """(NNX flat-state path, shape and stored dense dtype, logical axes) of every parameter, in model order."""
    abstract = abstract_model(config, dtype=COMPUTE_DTYPE)
    return [
        (path, variable.get_value(), variable.get_metadata()["out_sharding"])
        for path, variable in nnx.to_flat_state(nnx.state(abstract))
    ]


def _shard_rows(path: tuple, value, axes: tuple, stacked: bool, mesh: Mapping[str, int] | None) -> int:
    """Rows of the source tensor one device holds on `mesh` (all of them without a mesh)."""
    row_dim = 1 if stacked else 0
    rows = value.shape[row_dim]
    if not mesh:
        return rows
    spec = logical_to_spec(axes, value.shape, mesh, name=param_name(path))
    row_axes = spec[row_dim] if row_dim < len(spec) else None
    row_axes = () if row_axes is None else (row_axes,) if isinstance(row_axes, str) else row_axes
    return rows // math.prod(mesh[a] for a in row_axes)


def build_plan(
    resolver: TensorResolver, config: LingConfig | LingVLConfig, mode: str, mesh: Mapping[str, int] | None = None
) -> list[ParamPlan]:
    """The plan for every parameter, in model order. Raises CheckpointError naming the tensor and its file
    for a missing, mis-shaped, wrongly typed or unscaled tensor, and for tensors the config does not use;
    ShardingError for a `mesh` (axis sizes) whose axes do not divide a parameter."""
    if mode not in (BF16, FP8_KEPT):
        raise ValueError(f"--dtype must be {BF16!r} or {FP8_KEPT!r}, got {mode!r}")
    text = text_config_of(config)
    fp8_block = text.quantization.weight_block_size if text.quantization else (128, 128)
    plans, used = [], set()
    for path, value, axes in model_parameters(config):
        source = source_for(path, value.shape, text)
        shard_rows = _shard_rows(path, value, axes, source.stacked, mesh)
        used.update(source.names)
        sources = tuple(
            inspect_source(resolver.tensors, resolver.by_name.get(name), name, source.shape, fp8_block)
            for name in source.names
        )
        plans.append(
            _param_plan(path, tuple(value.shape), np.dtype(value.dtype), sources, source.stacked, mode, shard_rows)
        )
    resolver.refuse_unused(used)
    return plans


def owned_by(plans: list[ParamPlan], process_index: int, process_count: int) -> list[ParamPlan]:
    """The parameters process `process_index` converts: largest first to the least-loaded process."""
    load = [0] * process_count
    owner = {}
    for plan in sorted(plans, key=lambda p: -p.nbytes):
        target = load.index(min(load))
        owner[plan.name] = target
        load[target] += plan.nbytes
    return [plan for plan in plans if owner[plan.name] == process_index]
