"""How a model runs, as opposed to what it computes: the execution policy, one frozen object built once.

`ExecutionPolicy` holds the kernel backend, the KDA and MLA modes (and whether the KDA decode step is fused, how
many segments a KDA prefill splits a sequence into), the MoE exchange and capacity and how block-FP8 linears
multiply. Every field is an enum (or a checked number), so a misspelt value fails when the policy is built, naming
the field and the valid values, instead of deep inside a traced call. Strings are accepted and converted:
`"reference"` and `KernelBackend.REFERENCE` are the same value (the enums are `StrEnum`s). The models, the
checkpoint loaders and the layer functions take one as `policy=` (None: `ExecutionPolicy()`); config.json holds
none of it.

The KDA / MLA modes may stay None, meaning "chosen per call": recurrent KDA and absorbed MLA for a one-token
decode over a cache, chunked KDA and expanded MLA otherwise (`ExecutionPolicy.for_call`).

The model core passes the policy down and reads every mode from it; the `pallas_kernels` entry points keep their
own `backend=` argument, which `op_backend` gives from a policy where the core calls one.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

import jax

from pallas_kernels.backend import FP8Matmul, KernelBackend

if TYPE_CHECKING:
    from ling_jax.config import QuantizationConfig

__all__ = [
    "ExecutionPolicy",
    "FP8Matmul",
    "KDADecode",
    "KDAMode",
    "KernelBackend",
    "MLAMode",
    "MoEExchange",
    "as_policy",
    "op_backend",
]


class KDAMode(enum.StrEnum):
    CHUNKED = "chunked"
    RECURRENT = "recurrent"
    STEPS = "steps"  # recurrent, keeping the state after every token (speculative-decoding verification)


class KDADecode(enum.StrEnum):
    """How a recurrent KDA layer's one-token step runs between its projections."""

    AUTO = "auto"  # FUSED where the kernel backend is a GPU's (pallas_gpu, interpret_gpu), SEPARATE elsewhere
    SEPARATE = "separate"  # the convs, gates and norm as XLA ops around the recurrence kernel (`kda_decode_step`)
    FUSED = "fused"  # one op, one kernel on a GPU (`pallas_kernels.kda.kda_decode_fused`; the reference elsewhere)


# Calls over a cache of up to this many tokens a row (a decode step, an MTP verify or draft pass, a short prompt
# chunk) attend to the latent cache in absorbed form: expanding every cached key and value per head costs
# O(cache x heads x 256 x 512) whatever the call's length, the absorbed queries O(tokens x cache x heads x 1088).
ABSORBED_MAX_TOKENS = 16


class MLAMode(enum.StrEnum):
    EXPANDED = "expanded"  # flash-style prefill over expanded keys and values
    ABSORBED = "absorbed"  # W_UK / W_UV folded into the query and output: attention over the latent cache


class MoEExchange(enum.StrEnum):
    """How expert parallelism moves rows between devices (`ling_jax.moe.expert_parallel`)."""

    AUTO = "auto"
    RAGGED = "ragged"
    DENSE = "dense"


def _member(enum_type: type[enum.StrEnum], value: Any, field: str, *, optional: bool = False):
    if value is None and optional:
        return None
    try:
        return enum_type(value)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in enum_type) + (", None" if optional else "")
        raise ValueError(f"ExecutionPolicy.{field}: {value!r} is not one of {valid}") from None


@dataclasses.dataclass(frozen=True)
class ExecutionPolicy:
    kernel_backend: KernelBackend = KernelBackend.AUTO
    kda_mode: KDAMode | None = None  # None: per call (recurrent for one token, chunked otherwise)
    mla_mode: MLAMode | None = None  # None: per call (absorbed for a one-token decode over a cache)
    moe_exchange: MoEExchange = MoEExchange.AUTO
    moe_capacity_factor: float | None = None  # None: dropless; a number caps each device's rows per source
    fp8_matmul: FP8Matmul = FP8Matmul.AUTO
    kda_decode: KDADecode = KDADecode.AUTO
    # how many segments a chunked KDA call splits each sequence into (`pallas_kernels.kda.segments`): None by its
    # rule (on a GPU, for few sequence-heads and long prompts: B=1 prefill under tensor parallelism), 1 never, n always
    kda_segments: int | None = None
    # the chunk_kda variant a chunked KDA call runs (a name of `pallas_kernels.kda.ops.VARIANTS["chunk_kda"]`, such
    # as "gpu_triton_short"); None: the platform's bounded kernel where the gates' bound suits it, its any-gate one
    # otherwise (`ops.chunk_variant`, which refuses a bounded kernel for unbounded gates)
    kda_prefill: str | None = None
    # the mla_prefill variant an expanded MLA call runs (a name of `pallas_kernels.mla.ops.VARIANTS["mla_prefill"]`,
    # such as "gpu_mosaic"); None: the op's choice (`pallas_kernels.mla.mla_prefill`)
    mla_prefill: str | None = None

    def __post_init__(self):
        converted = {
            "kernel_backend": _member(KernelBackend, self.kernel_backend, "kernel_backend"),
            "kda_mode": _member(KDAMode, self.kda_mode, "kda_mode", optional=True),
            "mla_mode": _member(MLAMode, self.mla_mode, "mla_mode", optional=True),
            "moe_exchange": _member(MoEExchange, self.moe_exchange, "moe_exchange"),
            "fp8_matmul": _member(FP8Matmul, self.fp8_matmul, "fp8_matmul"),
            "kda_decode": _member(KDADecode, self.kda_decode, "kda_decode"),
        }
        for field, value in converted.items():
            object.__setattr__(self, field, value)
        segments = self.kda_segments
        if segments is not None and (isinstance(segments, bool) or not isinstance(segments, int) or segments < 1):
            raise ValueError(
                f"ExecutionPolicy.kda_segments: must be None (the rule) or a positive int, got {segments!r}"
            )
        for field, op in (("kda_prefill", "chunk_kda"), ("mla_prefill", "mla_prefill")):
            value = getattr(self, field)
            if value is not None and not isinstance(value, str):
                raise ValueError(
                    f"ExecutionPolicy.{field}: must be None (the platform's) or a {op} variant name, got {value!r}"
                )
        factor = self.moe_capacity_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0):
            raise ValueError(
                f"ExecutionPolicy.moe_capacity_factor: must be None (dropless) or a positive number, got {factor!r}"
            )

    def replace(self, **fields: Any) -> ExecutionPolicy:
        return dataclasses.replace(self, **fields)

    def for_checkpoint(self, quantization: QuantizationConfig | None) -> ExecutionPolicy:
        """This policy for a model of the checkpoint whose `quantization_config` is `quantization`: fp8_matmul AUTO
        (W8A8 for prefill-sized products on a GPU) stays where the checkpoint declares dynamic activation
        quantisation (`activation_scheme: dynamic`, the published block-FP8 checkpoints) or declares none (a preset
        is taken as published, as `memory_plan.stored_format` takes it), and becomes WEIGHT_ONLY elsewhere."""
        if self.fp8_matmul is not FP8Matmul.AUTO or quantization is None or quantization.activation_scheme == "dynamic":
            return self
        return self.replace(fp8_matmul=FP8Matmul.WEIGHT_ONLY)

    def for_call(
        self, length: int, *, cached: bool, kda_mode: KDAMode | None = None, mla_mode: MLAMode | None = None
    ) -> ExecutionPolicy:
        """This policy with both modes concrete for a call of `length` tokens (over a cache or not): the
        arguments first, then the policy's own modes, then the per-call defaults (MLA absorbed over a cache up to
        ABSORBED_MAX_TOKENS tokens, expanded otherwise)."""
        decode = length == 1
        kda = kda_mode or self.kda_mode or (KDAMode.RECURRENT if decode else KDAMode.CHUNKED)
        absorbed = cached and length <= ABSORBED_MAX_TOKENS
        mla = mla_mode or self.mla_mode or (MLAMode.ABSORBED if absorbed else MLAMode.EXPANDED)
        if kda == self.kda_mode and mla == self.mla_mode:
            return self
        return self.replace(kda_mode=kda, mla_mode=mla)


def as_policy(policy: ExecutionPolicy | None) -> ExecutionPolicy:
    """`policy`, or the default `ExecutionPolicy()` for None. Anything else, such as a bare kernel backend name,
    is refused: the policy is built once, by the caller (`ExecutionPolicy(kernel_backend="reference")`)."""
    if policy is None:
        return ExecutionPolicy()
    if not isinstance(policy, ExecutionPolicy):
        raise TypeError(
            f"policy must be an ExecutionPolicy or None, got {policy!r}"
            + (
                f" (for a kernel backend: ExecutionPolicy(kernel_backend={policy!r}))"
                if isinstance(policy, str)
                else ""
            )
        )
    return policy


def op_backend(policy: ExecutionPolicy, *, reference_on_mesh: bool = False) -> str:
    """The `backend=` argument of a `pallas_kernels` op the model core calls under `policy`: the policy's kernel
    backend, or "reference" under a mesh for an op given `reference_on_mesh` (the block-FP8 linear, whose Pallas
    call does not split over a mesh, and the decoder layers' norms)."""
    if reference_on_mesh and not jax.sharding.get_abstract_mesh().empty:
        return KernelBackend.REFERENCE.value
    return policy.kernel_backend.value
