"""Which of `sampling.sample`'s optional steps a batch uses, known on the host when its parameters are.

Each optional step (a grammar's bitmask, the presence / frequency penalties, logit bias, min tokens, the sampled draw,
top-k / top-p, logprobs) runs behind a `lax.cond` whose predicate is read from the batch's arrays on the device, so
one program serves every mix of parameters (ling-serve's slots change requests without recompiling). A program
traced with `SamplingFeatures.of(params)` instead leaves out, at trace time, every step no row of the batch uses:
no conditional at all in an all-greedy batch. A GPU program's conditional can cost more than its predicate (XLA
runs a `case` as a conditional node of the step's CUDA graph, or, where it cannot, reads the predicate back to the
host before going on). Both give every row the same tokens and logprobs: a skipped step changes no row that does not
use it. `GENERAL` (every step kept behind its cond) is the default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax

if TYPE_CHECKING:
    from ling_jax.generation.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class SamplingFeatures:
    """True: some row may use the step (it stays, behind its `lax.cond`); False: no row does (left out)."""

    grammar: bool = True
    penalties: bool = True  # presence / frequency
    logit_bias: bool = True
    min_tokens: bool = True
    sampled: bool = True  # temperature > 0
    truncated: bool = True  # top-k / top-p on a sampled row
    logprobs: bool = True

    @classmethod
    def of(cls, params: Sequence[SamplingParams], grammar: bool = False) -> SamplingFeatures:
        """The steps `params` (a batch's rows) use; grammar: whether any row may carry a grammar's bitmask."""
        sampled = [p for p in params if p.temperature > 0]
        return cls(
            grammar=grammar,
            penalties=any(p.presence_penalty or p.frequency_penalty for p in params),
            logit_bias=any(p.logit_bias for p in params),
            min_tokens=any(p.min_tokens and p.end_ids for p in params),
            sampled=bool(sampled),
            truncated=any(p.top_k > 0 or p.top_p < 1 for p in sampled),
            logprobs=any(p.logprobs is not None for p in params),
        )


GENERAL = SamplingFeatures()
# greedy rows and nothing else (no grammar, control or logprobs): a program without any conditional
PLAIN_GREEDY = SamplingFeatures(**{field.name: False for field in dataclasses.fields(SamplingFeatures)})


def when_used(used: bool, predicate: jax.Array, taken: Callable, skipped: Callable):
    """`lax.cond(predicate, taken, skipped)`, or `skipped()` alone where the host knows no row uses the step."""
    return jax.lax.cond(predicate, taken, skipped) if used else skipped()
