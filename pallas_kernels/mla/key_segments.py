"""The walk of the prefill kernels (`gpu_triton/prefill.py`, `gpu_mosaic_prefill.py`) over a latent cache in
segments of keys: the cache padded to whole segments (pad slots invalid), each segment up to the last slot a
query can see handed to the kernel's step with the running attention; the segments past it are never read."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def walk(latent_BSA, key_valid_BS, query_slots_BT, segment: int, add_segment, running):
    """`running` after add_segment(first slot, latent [B, segment, A], key_valid [B, segment], running) for each
    segment that holds a slot <= max(query_slots) (pad queries: slot -1)."""
    slots = latent_BSA.shape[1]
    pad = -slots % segment
    latent = jnp.pad(latent_BSA, ((0, 0), (0, pad), (0, 0)))
    key_valid = jnp.pad(key_valid_BS, ((0, 0), (0, pad)))

    def step(index, carry):
        first = index * segment
        block_BSA = jax.lax.dynamic_slice_in_dim(latent, first, segment, axis=1)
        valid_BS = jax.lax.dynamic_slice_in_dim(key_valid, first, segment, axis=1)
        return add_segment(first, block_BSA, valid_BS, carry)

    needed = jnp.clip(jnp.max(query_slots_BT) // segment + 1, 0, (slots + pad) // segment)
    return jax.lax.fori_loop(0, needed, step, running)
