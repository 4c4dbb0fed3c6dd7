"""Launch-setting variants that a benchmark times in the model on the same weights (`benchmarks.generate
--variants`): each variant is a set of patches TARGET.FIELD=VALUE over the tuned tables and module constants the
kernels read when traced, jax's trace caches cleared between variants so that every kernel is traced again.

A table patch sets the field in every entry of the table (every device and bucket: at batch 1 only the one-row /
one-token buckets run, at batch 8 the others); the integer fields of each table's tiles dataclass:

    gemv        `pallas_kernels.fp8.tuned.WEIGHT_ONLY_GEMV` (the decode gemv, its gated-norm form too)
    moe_swiglu  `pallas_kernels.moe.tuned.ROUTED_SWIGLU_QUANTIZED` (the row kernels on quantised experts)
    moe_down    `pallas_kernels.moe.tuned.ROUTED_DOWN_QUANTIZED`
    select      `pallas_kernels.moe.tuned.SELECT_EXPERTS`
    kda_decode  `pallas_kernels.kda.tuned.DECODE_FUSED_GPU` (the fused KDA decode step)
    mla_decode  `pallas_kernels.mla.tuned.DECODE_TRITON`
    mla_absorb  `pallas_kernels.mla.tuned.ABSORB_QUERY` (the absorbed query product), mla_expand `EXPAND_OUTPUT`
    mla.min_split  `pallas_kernels.mla.gpu_triton.decode.MIN_SPLIT`: the MLA decode's fewest slots a split
    fp8.gemv_rows  `pallas_kernels.fp8.tuned.GEMV_DEFAULT_ROWS`: the most rows a weight-only product runs the
                   decode gemv (its many-weight and gated-norm forms too) rather than the block-scaled kernel
    fp8.gemv_dot_rows  `pallas_kernels.fp8.tuned.GEMV_DOT_DEFAULT_ROWS`: the same for its tensor-core rows (from
                   GEMV_DOT_ROWS; 0: none)

    python -m benchmarks.generate ... --variants gemv.min_programs=1056,mla.min_split=64:moe_down.in_flight=1
"""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels.fp8 import tuned as fp8_tuned
from pallas_kernels.kda import tuned as kda_tuned
from pallas_kernels.mla import tuned as mla_tuned
from pallas_kernels.mla.gpu_triton import decode as mla_decode
from pallas_kernels.moe import tuned as moe_tuned

TABLES = {
    "gemv": fp8_tuned.WEIGHT_ONLY_GEMV,
    "moe_swiglu": moe_tuned.ROUTED_SWIGLU_QUANTIZED,
    "moe_down": moe_tuned.ROUTED_DOWN_QUANTIZED,
    "select": moe_tuned.SELECT_EXPERTS,
    "kda_decode": kda_tuned.DECODE_FUSED_GPU,
    "mla_decode": mla_tuned.DECODE_TRITON,
    "mla_absorb": mla_tuned.ABSORB_QUERY,
    "mla_expand": mla_tuned.EXPAND_OUTPUT,
}
CONSTANTS = {
    "mla.min_split": (mla_decode, "MIN_SPLIT"),
    "fp8.gemv_rows": (fp8_tuned, "GEMV_DEFAULT_ROWS"),
    "fp8.gemv_dot_rows": (fp8_tuned, "GEMV_DOT_DEFAULT_ROWS"),
}
_SHIPPED_TABLES = {name: dict(table) for name, table in TABLES.items()}
_SHIPPED_CONSTANTS = {name: getattr(module, attr) for name, (module, attr) in CONSTANTS.items()}


def _int_fields(table) -> list[str]:
    params = next(iter(table.values())).params
    return [f.name for f in dataclasses.fields(params) if f.type in (int, "int", "int | None")]


FIELDS = (*(f"{name}.{field}" for name, table in TABLES.items() for field in _int_fields(table)), *CONSTANTS)


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
    for name, table in TABLES.items():
        fields = {key.split(".", 1)[1]: value for key, value in patches.items() if key.split(".", 1)[0] == name}
        for key, entry in _SHIPPED_TABLES[name].items():
            table[key] = dataclasses.replace(entry, params=dataclasses.replace(entry.params, **fields))
    for name, (module, attr) in CONSTANTS.items():
        setattr(module, attr, patches.get(name, _SHIPPED_CONSTANTS[name]))
    jax.clear_caches()
    return "".join(f", {name} {value}" for name, value in patches.items())
