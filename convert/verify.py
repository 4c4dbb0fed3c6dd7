"""`--verify`: re-read every written slice from the merged checkpoint and compare it bit for bit with the value
re-derived from the source, rejecting NaN and Inf (in the source's dequantised values and in FP8 scales) unless
`--allow-nonfinite` accepted them."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp

from convert import ConvertError
from convert.plan import ParamPlan, Slice
from convert.slices import over_slices, slice_values
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
        derived = slice_values(plan, piece, reader)
        source = derived.source
        expected = [(derived.values, plan.name, plan.index(piece))]
        if derived.scale is not None:
            expected.append((derived.scale, scale_name(plan.name), plan.scale_index(piece)))
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
        return derived.nbytes

    over_slices(plans, check, workers, desc="verifying", progress=progress)
