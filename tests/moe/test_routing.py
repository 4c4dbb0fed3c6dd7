"""Group selection of the group-limited router (`pallas_kernels.moe.reference.kept_groups`) against a numpy
sort, ties included."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe.reference import kept_groups


def numpy_kept_groups(choice_TGS: np.ndarray, keep: int) -> np.ndarray:
    """Sum of each group's two best scores; the `keep` best groups, ties to the lower group (stable sort)."""
    score_TG = np.sort(choice_TGS, axis=-1)[..., -2:].sum(-1)
    order_TG = np.argsort(-score_TG, axis=-1, kind="stable")
    kept = np.zeros(score_TG.shape, bool)
    np.put_along_axis(kept, order_TG[:, :keep], True, axis=-1)
    return kept


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("groups, per_group, keep", [(8, 64, 4), (4, 4, 2), (5, 3, 1), (8, 2, 7)])
def test_kept_groups_match_a_stable_sort(ties, groups, per_group, keep):
    rng = np.random.default_rng(groups * per_group + keep)
    if ties:  # few distinct values: equal group scores and duplicated maxima within a group
        choice = rng.integers(0, 3, size=(64, groups, per_group)).astype(np.float32)
    else:
        choice = rng.normal(size=(64, groups, per_group)).astype(np.float32)
    ours = np.asarray(kept_groups(jnp.asarray(choice), keep))
    np.testing.assert_array_equal(ours, numpy_kept_groups(choice, keep))
    assert (ours.sum(-1) == keep).all()
