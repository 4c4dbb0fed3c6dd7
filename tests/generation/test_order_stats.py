"""order_stats: the k-th largest value, top-p's cutoff and top-k of [B, V] rows found by search, no sort, against
numpy's sort (float64 masses for top-p) and `jax.lax.top_k`; rows with ties, -inf and odd sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.generation import order_stats


@pytest.fixture(scope="module")
def rows():
    rng = np.random.default_rng(5)
    x = (3 * rng.normal(size=(5, 1001))).astype(np.float32)
    x[1, ::7] = x[1, 3]  # a value 143 times
    x[2, :500] = -np.inf  # masked tokens
    x[3] = np.round(x[3]) + 0.5  # ties everywhere
    x[4] = rng.uniform(-1e-3, 1e-3, size=1001).astype(np.float32) + 7.0  # values a few ulps apart
    return x


@pytest.mark.parametrize("k", [1, 2, 20, 143, 500, 1001])
def test_kth_largest_and_top_k_match_the_sort(rows, k):
    k_B = jnp.full((len(rows),), k, jnp.int32)
    np.testing.assert_array_equal(order_stats.kth_largest(jnp.asarray(rows), k_B), -np.sort(-rows, axis=1)[:, k - 1])
    values, indices = order_stats.top_k(jnp.asarray(rows), k)
    want_values, want_indices = jax.lax.top_k(jnp.asarray(rows), k)  # equal values: lowest index first
    np.testing.assert_array_equal(values, want_values)
    np.testing.assert_array_equal(indices, want_indices)


def _top_p_kept(x, floor, top_p):
    """float64: the values >= floor, sorted; keep each whose mass before it is below top_p (all for top_p 1)."""
    kept = np.zeros(x.shape, bool)
    for row in range(len(x)):
        order = np.argsort(-x[row], kind="stable")
        order = order[x[row, order] >= floor[row]]
        probs = np.exp(x[row, order].astype(np.float64) - x[row].max())
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        last = order[before < top_p[row]][-1] if top_p[row] < 1 else order[-1]
        kept[row] = x[row] >= x[row, last]
    return kept


@pytest.mark.parametrize("top_k", [0, 1, 7, 400])
def test_top_p_cutoff_keeps_the_smallest_prefix_reaching_p(rows, top_k):
    top_p = np.array([0.05, 0.5, 0.9, 0.999, 1.0], np.float32)
    vocab = rows.shape[1]
    k_B = jnp.full((len(rows),), top_k if top_k else vocab, jnp.int32)
    floor = order_stats.kth_largest(jnp.asarray(rows), k_B)
    cutoff = order_stats.top_p_cutoff(jnp.asarray(rows), floor, jnp.asarray(top_p))
    np.testing.assert_array_equal(rows >= np.asarray(cutoff)[:, None], _top_p_kept(rows, np.asarray(floor), top_p))
