"""The slices of a conversion's plans, as the conversion and `--verify` both walk them: what a slice holds as the
checkpoint stores it (`slice_values`), and a pass over every slice of the plans on a thread pool with a byte progress
bar (`over_slices`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from tqdm.auto import tqdm

from convert.hooks import to_dense, to_fp8
from convert.parallel import run_bounded
from convert.plan import ParamPlan, Slice
from convert.source import ShardReader, SourceTensor

Item = tuple[ParamPlan, Slice]


@dataclasses.dataclass(frozen=True)
class SliceValues:
    source: SourceTensor  # the tensor the slice's rows come from
    values: np.ndarray  # the rows as stored: dense in the plan's dtype, or FP8 codes
    scale: np.ndarray | None  # FP8: the codes' float32 block scales; None: dense
    nbytes: int  # bytes read from the checkpoint


def slice_values(plan: ParamPlan, piece: Slice, reader: ShardReader) -> SliceValues:
    """The rows of `piece` read from its source tensor and converted as `plan` stores them (dense, or FP8 with
    scales where the plan keeps a scale block)."""
    source = plan.sources[piece.expert or 0]
    rows = reader.read_rows(source, piece.start, piece.stop)
    if plan.scale_block is None:
        return SliceValues(source, to_dense(rows, source, plan.dtype), None, rows.nbytes)
    return SliceValues(source, *to_fp8(rows, source), rows.nbytes)


def over_slices(
    plans: list[ParamPlan],
    work: Callable[[Item], int],
    workers: int,
    *,
    desc: str,
    progress: bool,
    on_done: Callable[[Item, int], None] | None = None,
) -> None:
    """work((plan, piece)) -> the bytes it read, for every slice of every plan on `workers` threads (`run_bounded`),
    a progress bar `desc` over the plans' bytes (shown when `progress`) moved as each finishes, then on_done(item,
    bytes) on this thread."""
    items = ((plan, piece) for plan in plans for piece in plan.slices())
    with tqdm(
        total=sum(plan.nbytes for plan in plans),
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not progress,
    ) as bar:

        def finished(item: Item, nbytes: int) -> None:
            bar.update(nbytes)
            if on_done is not None:
                on_done(item, nbytes)

        run_bounded(items, work, workers, finished)
