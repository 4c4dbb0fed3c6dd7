"""Kernel variants by name: every public op lists its implementations in a registry (`<op>/ops.py`'s VARIANTS),
and one rule picks the one that runs.

A variant is named by its platform and lowering ("gpu_triton", "gpu_mosaic", "tpu_mosaic"); "reference" is the
op's jnp reference (`<op>/reference.py`), which runs anywhere. The backend says where and how kernels run
(`backend.resolve_backend`: compiled on a GPU or TPU, or in Pallas interpret mode on any platform); the variant
says which implementation: the op's own choice for that backend and those shapes when none is named.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, MutableMapping

from pallas_kernels.backend import KERNEL_TARGET

REFERENCE = "reference"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One implementation of an op. platform: "gpu" or "tpu" for a Pallas kernel (compiled there, or interpreted
    on any platform with the matching "interpret_*" backend), None for the jnp reference. kernel: its entry
    point; a kernel variant's takes the op's arrays, the op's keywords, `interpret` and block-size overrides
    (None: the op's `tuned.py` table). takes: which calls it supports, asked with the op's arrays (and the
    keywords the op documents for it); None: every call the op accepts."""

    platform: str | None
    kernel: Callable
    takes: Callable[..., bool] | None = None

    def supports(self, *args, **kwargs) -> bool:
        return self.takes is None or self.takes(*args, **kwargs)


Registry = Mapping[str, MutableMapping[str, Variant]]


def lookup(registry: Registry, op: str, name: str) -> Variant:
    """registry[op][name], or a ValueError naming the known ops or variants."""
    if op not in registry:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(registry)}")
    if name not in registry[op]:
        raise ValueError(f"unknown variant {name!r} of {op}; known: {', '.join(registry[op])}")
    return registry[op][name]


def register(registry: Registry, op: str, name: str, variant: Variant) -> None:
    """Adds variant `name` of `op` to the registry (an experimental module does, when imported); a name already
    taken is refused."""
    if name in registry[op]:
        raise ValueError(f"variant {name!r} of {op} is already registered")
    registry[op][name] = variant


def pick(registry: Registry, op: str, name: str | None, backend: str, default: str) -> str:
    """The variant of `op` to run on the resolved `backend`: `name` when given (checked: known, and of the
    backend's platform), else `default` (the op's own choice)."""
    if name is None:
        return default
    platform = lookup(registry, op, name).platform
    if platform is not None and KERNEL_TARGET.get(backend) != platform:
        raise ValueError(
            f"variant {name!r} of {op} is a {platform} kernel: it runs with backend 'pallas_{platform}' "
            f"or 'interpret_{platform}', not {backend!r}"
        )
    return name


def by_platform(backend: str, kernels: Mapping[str, str]) -> str:
    """The variant of kernels[platform] for the backend's platform, the reference where it has none."""
    return kernels.get(KERNEL_TARGET.get(backend), REFERENCE)


def interpreted(backend: str) -> bool:
    return backend.startswith("interpret")


def run(registry: Registry, op: str, name: str, backend: str, *args, **keywords):
    """Variant `name` of `op` on the op's arrays and keywords: a kernel variant's entry point with `interpret` for the
    resolved `backend` added (Pallas interpret mode on an "interpret_*" backend), the reference's as given."""
    variant = lookup(registry, op, name)
    if variant.platform is not None:
        keywords["interpret"] = interpreted(backend)
    return variant.kernel(*args, **keywords)
