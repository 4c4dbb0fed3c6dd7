"""Tuning tables: block sizes keyed by (device kind, shape bucket, dtype), one table per kernel in `<op>/tuned.py`.

A key is (device, bucket, dtype): device a `jax.Device.device_kind` ("NVIDIA H200"), bucket a name the op's
`tuned.py` derives from the shapes ("decode", "prefill"), dtype a dtype name ("bfloat16") or a width class
("16bit": bf16 and fp16). ANY matches everything in its place. `lookup` tries the device, then ANY; within
it the bucket, then ANY; within that the dtype's name, its width class, then ANY: the most specific entry wins,
and an ANY-everything entry is the default for unknown devices. Each entry cites the measurement it comes from
(a BENCHMARKS.md section and row), so a table is also the list of what was measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp

ANY = "*"
H200 = "NVIDIA H200"


@dataclasses.dataclass(frozen=True)
class Entry:
    """params: a frozen dataclass of launch settings; source: where they were measured (BENCHMARKS.md section,
    row), or why they were chosen without a measurement."""

    params: object
    source: str


Table = Mapping[tuple[str, str, str], Entry]


def device_kind() -> str:
    return jax.devices()[0].device_kind


def width_class(dtype) -> str:
    return f"{8 * jnp.dtype(dtype).itemsize}bit"


def lookup(table: Table, *, dtype, bucket: str = ANY, device: str | None = None):
    """The params of the most specific entry for (device, bucket, dtype); device defaults to the first device's
    kind (what runs the kernel, or the CPU in interpret mode: the default entries)."""
    device = device_kind() if device is None else device
    dtypes = (jnp.dtype(dtype).name, width_class(dtype), ANY)
    for key in ((d, b, t) for d in (device, ANY) for b in (bucket, ANY) for t in dtypes):
        if key in table:
            return table[key].params
    raise LookupError(
        f"no tuning entry for device {device!r}, bucket {bucket!r}, dtype {dtypes[0]}: a table needs "
        f"a default entry (device {ANY!r}) for every bucket it uses"
    )


def fill(given: tuple, defaults) -> tuple:
    """The given launch settings, None ones and any trailing ones not given taken from the defaults (a tuple, or a
    params dataclass in field order)."""
    defaults = defaults if isinstance(defaults, tuple) else dataclasses.astuple(defaults)
    if len(given) > len(defaults):
        raise ValueError(f"launch settings {given}: at most {len(defaults)} expected (defaults {defaults})")
    given = (*given, *(None,) * (len(defaults) - len(given)))
    return tuple(default if value is None else value for value, default in zip(given, defaults, strict=True))
