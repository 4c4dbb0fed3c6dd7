"""The served decode program reads and writes the slots' state in place: its compiled HLO (on the CPU, the demo
checkpoint) copies no KDA recurrent state or conv window, seen-token mask or token counts, and aliases each of
them, donated, to its output, for a bucket of every slot (one step) and a smaller one (several steps,
`decode_steps`). With MTP (a speculative round of every slot) no copy of a donated slot-state buffer is made either
(KDA states and conv windows, MLA pages, seen tokens and counts, the MTP cache, draft hidden and carry), and each is
aliased to its output (tests/serving/test_scheduler.py checks an idle slot's state bit for bit)."""

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
SLOT_STATE = r"cache_layers_\d+__(?:recurrent_state|conv_window)|seen_BV|counts_BV"
MTP_SLOT_STATE = SLOT_STATE + r"|cache_layers_\d+__latent_pages|drafts_(?:cache_layer_latent|draft_hidden_BD|carry_BD)"


def _hlo_shape(x) -> str:
    return f"{HLO_TYPES[np.dtype(x.dtype).name]}[{','.join(map(str, x.shape))}]"


def _compiled_step(engine: Engine, rows: int, steps: int) -> str:
    """The HLO of the engine's step program over `rows` slots, `steps` steps (or rounds)."""
    arrays = SamplingArrays.from_params([GREEDY] * MAX_BATCH, engine.config.vocab_size)
    active_R, capacity_R = jnp.zeros(rows, bool), jnp.zeros(rows, jnp.int32)
    args = (engine.static, engine.mtp, rows, steps, engine.leaves, engine._synced(), arrays, active_R, capacity_R)
    return _step.lower(*args, jnp.asarray(engine.end_bits_BW)).compile().as_text()


def _donated_and_aliased(hlo: str, names: str) -> tuple[list[int], set[int]]:
    """The parameter numbers of the state buffers `names` matches, and the parameters aliased to an output."""
    aliased = {int(p) for p in re.findall(r"\((\d+), \{\}, (?:may|must)-alias\)", hlo.splitlines()[0])}
    return [int(p) for p in re.findall(rf"%state_(?:{names})\S* = \S+ parameter\((\d+)\)", hlo)], aliased


@pytest.mark.parametrize(("rows", "steps"), [(MAX_BATCH, 1), (2, 4)])
def test_step_copies_no_slot_state(demo_model, rows, steps):
    engine = Engine(demo_model, max_batch=MAX_BATCH, max_context=64, prefill_chunk=16)
    hlo = _compiled_step(engine, rows, steps)
    state = engine.state
    kda = [s for s in state.cache.layers if isinstance(s, KDAState)]
    buffers = [x for s in kda for x in (s.recurrent_state, s.conv_window)] + [state.seen_BV, state.counts_BV]
    shapes = {_hlo_shape(x) for x in buffers}
    copied = re.findall(r"= (\w+\[[\d,]*\])\{[\d,]*\} copy\(", hlo)
    assert not shapes & set(copied), f"the step copies slot state: {sorted(shapes & set(copied))}"
    params, aliased = _donated_and_aliased(hlo, SLOT_STATE)
    assert len(params) == len(buffers) and set(params) <= aliased


def test_mtp_step_copies_no_slot_state(demo_model):
    engine = Engine(demo_model, max_batch=MAX_BATCH, max_context=64, prefill_chunk=16, mtp=2)
    hlo = _compiled_step(engine, MAX_BATCH, 1)
    copied = re.findall(rf"copy\(%state_((?:{MTP_SLOT_STATE})\S*)\)", hlo)
    assert not copied, f"the MTP step copies slot state: {sorted(copied)}"
    params, aliased = _donated_and_aliased(hlo, MTP_SLOT_STATE)
    layers = engine.state.cache.layers
    assert len(params) == sum(2 if isinstance(s, KDAState) else 1 for s in layers) + 2 + 3
    assert set(params) <= aliased
