"""Launch-setting variants that a benchmark times in the model on the same weights (`benchmarks.generate
--variants`): each variant is a set of patches TARGET.FIELD=VALUE over the tuned tables and module constants the
kernels read when traced, jax's trace caches cleared between variants so that every kernel is traced again.

    gemv.FIELD=N     every `pallas_kernels.fp8.tuned.WEIGHT_ONLY_GEMV` entry's `GemvTiles` field (integer fields)
    mla.min_split=N  `pallas_kernels.mla.gpu_triton.decode.MIN_SPLIT`: the decode kernel's fewest slots a split

    python -m benchmarks.generate ... --variants gemv.min_programs=1056,mla.min_split=64:gemv.blocks_per_step=2
"""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels.fp8 import tuned as fp8_tuned
from pallas_kernels.mla.gpu_triton import decode as mla_decode

_GEMV_TABLE = dict(fp8_tuned.WEIGHT_ONLY_GEMV)
_MLA_MIN_SPLIT = mla_decode.MIN_SPLIT
_GEMV_FIELDS = {field.name for field in dataclasses.fields(fp8_tuned.GemvTiles) if field.type in (int, "int")}
FIELDS = (*(f"gemv.{name}" for name in sorted(_GEMV_FIELDS)), "mla.min_split")


def parse(text: str) -> dict[str, int]:
    """{TARGET.FIELD: value} of TARGET.FIELD=VALUE[:TARGET.FIELD=VALUE...]; ValueError naming what is expected."""
    patches = {}
    for item in text.split(":"):
        name, _, value = item.partition("=")
        if name not in FIELDS or not value.isdigit():
            expected = ", ".join(FIELDS)
            raise ValueError(f"expected TARGET.FIELD=INTEGER with TARGET.FIELD one of {expected}, got {item!r}")
        patches[name] = int(value)
    return patches


def apply(patches: dict[str, int]) -> str:
    """Set these patches ({}: the tables and constants as shipped) and clear jax's caches; a label for the rows."""
    gemv = {name.removeprefix("gemv."): value for name, value in patches.items() if name.startswith("gemv.")}
    for key, entry in _GEMV_TABLE.items():
        fp8_tuned.WEIGHT_ONLY_GEMV[key] = dataclasses.replace(entry, params=dataclasses.replace(entry.params, **gemv))
    mla_decode.MIN_SPLIT = patches.get("mla.min_split", _MLA_MIN_SPLIT)
    jax.clear_caches()
    return "".join(f", {name} {value}" for name, value in patches.items())
