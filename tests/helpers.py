"""Small helpers shared by the tests."""

from __future__ import annotations

import numpy as np


def rel_error(ours, ref) -> float:
    """||ours - ref|| / ||ref|| in float64."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def l2(x):
    """FLA's l2 normalisation (eps inside the sqrt), in numpy."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)
