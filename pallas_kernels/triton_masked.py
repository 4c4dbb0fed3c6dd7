"""Masked tile loads shared by the Triton kernels (MoE, FP8): a 2-D mask from its row and column masks, and a load
that reads zeros where the mask is false."""

from __future__ import annotations

from jax.experimental.pallas import triton as plgpu


def mask_2d(rows_ok, cols_ok):
    """rows_ok[:, None] & cols_ok[None, :]; None stands for all true (both None: no mask)."""
    if rows_ok is None:
        return None if cols_ok is None else cols_ok[None, :]
    return rows_ok[:, None] if cols_ok is None else rows_ok[:, None] & cols_ok[None, :]


def masked_load(ref, mask, **kwargs):
    """ref's tile with zeros where mask is false (mask None: a plain load); kwargs: `plgpu.load`'s others (e.g.
    eviction_policy)."""
    return plgpu.load(ref, mask=mask, other=None if mask is None else 0.0, **kwargs)
