"""The XLA:CPU YNNPACK-fusion miscompile (jaxlib 0.10.2 / 0.11.2) that `pallas_kernels/compat.py` works around:
jitted programs at head_dim 128 (the chunked KDA with a zero initial state made inside the jit, a whole decoder
layer) against eager runs and the float64 recurrence. Without the workaround each of these is ~100% off or NaN."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers import l2, rel_error
from np_reference import kda_recurrence

from ling_jax.cache import KDAState
from ling_jax.config import DENSE, KDA
from ling_jax.model import DecoderLayer, token_context
from ling_jax.policy import ExecutionPolicy
from ling_jax.presets import preset
from pallas_kernels.kda.ops import chunk_kda
from pallas_kernels.kda.reference import kda_chunked


def test_smallest_miscompiled_program():
    """The XLA-level reproducer: a reduce feeding a dot, plus a dot with a broadcast constant, in one fusion."""
    a = jax.random.normal(jax.random.key(0), (32, 32, 128))
    c = jax.random.normal(jax.random.key(1), (32, 128))
    x = jax.random.normal(jax.random.key(2), (32, 128))

    def f(a, c, x):
        return jnp.sum(a, -1) @ c + x @ jnp.zeros((128, 128))

    eager = np.asarray(f(a, c, x))
    assert rel_error(jax.jit(f)(a, c, x), eager) < 1e-5


def test_jitted_chunked_kda_at_head_dim_128_matches_float64_recurrence():
    r = np.random.default_rng(0)
    batch, length, heads, dim = 2, 10, 2, 128
    q, k, v = (r.normal(size=(batch, length, heads, dim)) for _ in range(3))
    g = -5.0 * r.uniform(size=(batch, length, heads, dim))
    beta = r.uniform(0.05, 1.0, size=(batch, length, heads))
    o_ref, s_ref = kda_recurrence(l2(q), l2(k), v, g, beta)
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)]
    for name, run in [
        ("kda_chunked", lambda *a: kda_chunked(*a)),  # zero state made inside the jit
        ("chunk_kda", lambda *a: chunk_kda(*a, backend="reference")),
    ]:
        # the outputs alone (as a model uses them): returning the state too changed the fusions and hid the bug
        assert rel_error(jax.jit(lambda *a: run(*a)[0])(*args), o_ref) < 1e-5, name
        assert rel_error(jax.jit(lambda *a: run(*a)[1])(*args), s_ref) < 1e-5, name


def test_jitted_decoder_layer_at_head_dim_128_matches_eager_recurrent():
    config = preset("ling-3.1-flash").replace(
        num_hidden_layers=1,
        layer_types=(KDA,),
        mlp_layer_types=(DENSE,),
        num_nextn_predict_layers=0,
        hidden_size=64,
        num_attention_heads=2,
        intermediate_size=256,
    )
    assert config.head_dim == 128
    layer = DecoderLayer(config, attention=KDA, mlp=DENSE, clip_layer=0, dtype=jnp.float32, rngs=nnx.Rngs(0))
    h = 0.02 * jax.random.normal(jax.random.key(3), (2, 10, config.hidden_size))

    def run(layer, h, kda_mode):
        ctx = token_context(
            config,
            2,
            10,
            positions=None,
            attention_mask=None,
            lengths=None,
            max_length=0,
            kda_mode=kda_mode,
            mla_mode=None,
            policy=ExecutionPolicy(kernel_backend="reference"),
        )
        return layer(h, ctx, KDAState.zeros(config, 2, h.dtype))[0]

    expected = run(layer, h, "recurrent")  # eager, one token at a time
    graph, params = nnx.split(layer)
    jitted = jax.jit(lambda params, h: run(nnx.merge(graph, params), h, "chunked"))(params, h)
    assert np.isfinite(np.asarray(jitted)).all()
    assert rel_error(jitted, expected) < 1e-5
