"""`--verify`: re-read every written slice from the merged checkpoint and compare it bit for bit with the value
re-derived from the source, rejecting NaN and Inf (in the source's dequantised values and in FP8 scales) unless
`--allow-nonfinite` accepted them."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from convert import ConvertError
from convert.hooks import to_dense, to_fp8
from convert.parallel import run_bounded
from convert.plan import ParamPlan, Slice
from convert.source import ShardReader
from convert.store import ArrayStore
from ling_jax.checkpoints.orbax import scale_name

_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


@jax.jit
def _equal_and_finite(expected, actual):
    def bits(x):
        return jax.lax.bitcast_convert_type(x, _BITS[x.dtype.itemsize])

    return jnp.array_equal(bits(expected), bits(actual)), jnp.isfinite(expected).all()


def verify_params(
    plans: list[ParamPlan], reader: ShardReader, store: ArrayStore, workers: int, progress: bool, allow_nonfinite: bool
) -> None:
    """Raise ConvertError naming the parameter, the source tensor and its file at the first bad slice."""
    opened: dict[str, object] = {}
    lock = threading.Lock()

    def array(name: str):
        with lock:
            if name not in opened:
                opened[name] = store.open_merged(name)
            return opened[name]

    def check(item: tuple[ParamPlan, Slice]) -> int:
        plan, piece = item
        source = plan.sources[piece.expert or 0]
        rows = reader.read_rows(source, piece.start, piece.stop)
        if plan.scale_block is None:
            expected = [(to_dense(rows, source, plan.dtype), plan.name, plan.index(piece))]
        else:
            values, scale = to_fp8(rows, source)
            expected = [(values, plan.name, plan.index(piece)), (scale, scale_name(plan.name), plan.scale_index(piece))]
        for want, name, index in expected:
            got = array(name)[index].read().result()
            equal, finite = _equal_and_finite(want.reshape(got.shape), got)
            where = f"rows {piece.start}..{piece.stop}"
            if not finite and not allow_nonfinite:
                raise ConvertError(f"{source.file}: tensor '{source.name}' has NaN or Inf values in {where}")
            if not equal:
                raise ConvertError(
                    f"{store.directory}: array '{name}' differs from '{source.name}' ({source.file}) in {where}"
                )
        return rows.nbytes

    items = ((plan, piece) for plan in plans for piece in plan.slices())
    with tqdm(
        total=sum(p.nbytes for p in plans),
        desc="verifying",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not progress,
    ) as bar:
        run_bounded(items, check, workers, lambda item, nbytes: bar.update(nbytes))
