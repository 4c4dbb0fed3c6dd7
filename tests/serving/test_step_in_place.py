"""The served decode program reads and writes the slots' state in place: its compiled HLO (on the CPU, the demo
checkpoint) copies no KDA recurrent state or conv window, seen-token mask or token counts, and aliases each of
them, donated, to its output, for a bucket of every slot (one step) and a smaller one (several steps,
`decode_steps`)."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.cache import KDAState
from ling_jax.generation.sampling import SamplingArrays
from ling_jax.serving.engine import GREEDY, Engine, _step

MAX_BATCH = 3
HLO_TYPES = {"float32": "f32", "bfloat16": "bf16", "bool": "pred", "int32": "s32"}


def _hlo_shape(x) -> str:
    return f"{HLO_TYPES[np.dtype(x.dtype).name]}[{','.join(map(str, x.shape))}]"


@pytest.mark.parametrize(("rows", "steps"), [(MAX_BATCH, 1), (2, 4)])
def test_step_copies_no_slot_state(demo_model, rows, steps):
    engine = Engine(demo_model, max_batch=MAX_BATCH, max_context=64, prefill_chunk=16)
    state = engine._synced()
    arrays = SamplingArrays.from_params([GREEDY] * MAX_BATCH, engine.config.vocab_size)
    active_R, capacity_R = jnp.zeros(rows, bool), jnp.zeros(rows, jnp.int32)
    hlo = (
        _step.lower(engine.static, 0, rows, steps, engine.leaves, state, arrays, active_R, capacity_R)
        .compile()
        .as_text()
    )
    kda = [s for s in state.cache.layers if isinstance(s, KDAState)]
    buffers = [x for s in kda for x in (s.recurrent_state, s.conv_window)] + [state.seen_BV, state.counts_BV]
    shapes = {_hlo_shape(x) for x in buffers}
    copied = re.findall(r"= (\w+\[[\d,]*\])\{[\d,]*\} copy\(", hlo)
    assert not shapes & set(copied), f"the step copies slot state: {sorted(shapes & set(copied))}"
    aliased = {int(p) for p in re.findall(r"\((\d+), \{\}, (?:may|must)-alias\)", hlo.splitlines()[0])}
    names = r"cache_layers_\d+__(?:recurrent_state|conv_window)|seen_BV|counts_BV"
    params = re.findall(rf"%state_(?:{names})\S* = \S+ parameter\((\d+)\)", hlo)
    assert len(params) == len(buffers) and {int(p) for p in params} <= aliased
