"""Greedy batched generation: one jitted prefill, then a jitted single-token decode step over a donated cache.

Prompts of different lengths are left-padded; the attention mask keeps pads out of every state.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling_jax.model import LingForCausalLM


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _greedy_call(graphdef, params, cache, ids_BT, mask_BT):
    out = nnx.merge(graphdef, params)(ids_BT, cache=cache, attention_mask=mask_BT)
    return jnp.argmax(out.logits[:, -1], axis=-1).astype(jnp.int32), out.cache


def greedy_generate(model: LingForCausalLM, prompts: list[list[int]], max_new_tokens: int,
                    *, eos_ids: tuple[int, ...] = ()) -> tuple[list[list[int]], dict]:
    """Greedy continuation of each prompt (token ids). Returns (new tokens per prompt, timing stats)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    longest = max(len(p) for p in prompts)
    max_length = longest + max_new_tokens
    if max_length > model.config.max_position_embeddings:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"max_position_embeddings ({model.config.max_position_embeddings})")
    batch = len(prompts)
    ids = np.zeros((batch, longest), np.int32)
    mask = np.zeros((batch, longest), bool)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = prompt
        mask[row, longest - len(prompt):] = True
    graphdef, params = nnx.split(model)
    cache = model.init_cache(batch, max_length)
    start = time.perf_counter()
    token, cache = _greedy_call(graphdef, params, cache, jnp.asarray(ids), jnp.asarray(mask))
    token.block_until_ready()
    prefill_s = time.perf_counter() - start
    generated = [[] for _ in prompts]
    done = np.zeros(batch, bool)
    ones = jnp.ones((batch, 1), bool)
    start = time.perf_counter()
    for step in range(max_new_tokens):
        host = np.asarray(token)
        for row in np.flatnonzero(~done):
            generated[row].append(int(host[row]))
            done[row] = host[row] in eos_ids
        if done.all() or step == max_new_tokens - 1:
            break
        token, cache = _greedy_call(graphdef, params, cache, token[:, None], jnp.logical_and(ones, ~done[:, None]))
    decode_s = time.perf_counter() - start
    stats = {"prompt_tokens": int(mask.sum()), "generated_tokens": sum(map(len, generated)),
             "prefill_s": prefill_s, "decode_s": decode_s}
    return generated, stats
