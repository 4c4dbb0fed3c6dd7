"""Sharding rules and expert parallelism on 8 virtual CPU devices (conftest sets the XLA flag)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import np_reference as npr
import numpy as np
import pytest
from flax import nnx
from helpers import rel_error
from jax.sharding import PartitionSpec as P
from tiny_fp8 import sharding_test_config

from ling_jax import ExecutionPolicy, LingConfig, LingForCausalLM
from ling_jax.generation.sharded import ShardedLM
from ling_jax.moe import expert_parallel
from ling_jax.moe import experts as moe_experts
from ling_jax.moe.block import MoE, route
from ling_jax.moe.expert_parallel import (
    emulated_ragged_all_to_all,
    moe_parallel,
    ragged_dispatch,
    ragged_return_and_combine,
    ragged_routes,
    resolve_exchange,
    rows_per_source,
)
from ling_jax.moe.experts import dense_expert_ffn, local_moe
from ling_jax.sharding import ShardingError, cache_shardings, make_mesh, param_shardings, parse_mesh
from pallas_kernels.moe.ops import ExpertWeights, Routing

TOL = 1e-5
# Every axis in a mesh with more than one device; expert=8 alone is covered by the expert-parallel MoE tests below
# (moe_parallel against the dense baseline) and by the placement test (test_each_device_holds_its_share_of_experts).
MESHES = [{"data": 2, "expert": 4}, {"tensor": 2, "expert": 4}, {"fsdp": 2, "tensor": 2, "expert": 2}]


def _config(**changes) -> LingConfig:
    """Two layers, KDA + dense MLP and MLA + MoE: every kind of block once (the tiny preset's four repeat them)."""
    return sharding_test_config().replace(**changes)


def _model(config, seed=0, policy=None):
    return LingForCausalLM(config, rngs=nnx.Rngs(seed), dtype=jnp.float32, policy=policy)


def _inputs(config, batch=8, length=13):
    ids = jax.random.randint(jax.random.key(1), (batch, length), 0, config.vocab_size)
    mask = np.ones((batch, length), bool)
    mask[1, :5] = False  # left padding on two rows
    mask[6, :12] = False  # a one-token prompt
    return ids, jnp.asarray(mask)


def _prefill_decode(call, init_cache, ids, mask, steps=2):
    cache = init_cache(ids.shape[0], ids.shape[1] + steps)
    logits, cache = call(ids, cache=cache, attention_mask=mask)
    outs = [logits[:, -1]]
    token = jnp.argmax(logits[:, -1], -1)[:, None]
    for _ in range(steps):
        logits, cache = call(token, cache=cache, attention_mask=jnp.ones(token.shape, bool))
        outs.append(logits[:, -1])
        token = jnp.argmax(logits[:, -1], -1)[:, None]
    return np.stack([np.asarray(o) for o in outs])


@pytest.fixture(scope="module")
def reference():
    """The unsharded model's forward and prefill + 2 decode steps (jitted: one compile each, not op by op)."""
    config = _config()
    graphdef, state = nnx.split(_model(config))
    ids, mask = _inputs(config)
    full = jax.jit(lambda s, i, m: nnx.merge(graphdef, s)(i, attention_mask=m).logits)(state, ids, mask)

    @jax.jit
    def step(s, ids, cache, attention_mask):
        out = nnx.merge(graphdef, s)(ids, cache=cache, attention_mask=attention_mask)
        return out.logits, out.cache

    def init_cache(batch, length):
        return nnx.merge(graphdef, state).init_cache(batch, length)

    decoded = _prefill_decode(lambda *a, **k: step(state, *a, **k), init_cache, ids, mask)
    return config, ids, mask, np.asarray(full), decoded


@pytest.mark.parametrize(
    ("shape", "exchange"),
    [*((shape, "dense") for shape in MESHES), ({"data": 2, "expert": 4}, "ragged")],
    ids=lambda v: ",".join(f"{k}={n}" for k, n in v.items()) if isinstance(v, dict) else v,
)
def test_sharded_forward_and_decode_match_unsharded(reference, shape, exchange):
    """The dense exchange on each mesh, and the ragged all-to-all (emulated on the CPU) through the whole model."""
    config, ids, mask, full, decoded = reference
    sharded = ShardedLM(_model(config, policy=ExecutionPolicy(moe_exchange=exchange)), make_mesh(shape))
    err_full = rel_error(sharded(ids, attention_mask=mask), full)
    err_decode = rel_error(_prefill_decode(sharded, sharded.init_cache, ids, mask), decoded)
    print(f"{shape} {exchange}: forward rel. error {err_full:.1e}, prefill + 2 decode steps {err_decode:.1e}")
    assert err_full <= TOL and err_decode <= TOL


@pytest.mark.parametrize("shape", [{"expert": 8}, {"tensor": 2, "expert": 4}])
def test_each_device_holds_its_share_of_experts(shape):
    config = _config()
    mesh = make_mesh(shape)
    sharded = ShardedLM(_model(config), mesh)
    ep, tp = shape["expert"], shape.get("tensor", 1)
    params = nnx.merge(sharded.graphdef, sharded.params)
    moe_layers = [layer.mlp for layer in params.model.layers if isinstance(layer.mlp, MoE)]
    assert moe_layers
    for moe in moe_layers:
        gate = moe.experts.gate_proj[...]
        shards = gate.addressable_shards
        assert len(shards) == 8
        for shard in shards:
            assert shard.data.shape == (
                config.num_experts // ep,
                config.moe_intermediate_size // tp,
                config.hidden_size,
            )
        first_experts = {shard.index[0].start or 0 for shard in shards}
        assert first_experts == set(range(0, config.num_experts, config.num_experts // ep))


def test_cache_shardings_split_batch_and_kda_heads():
    config = _config()
    mesh = make_mesh({"tensor": 2, "expert": 4})
    cache = jax.eval_shape(lambda: _model(config).init_cache(8, 16))
    shardings = cache_shardings(cache, mesh)
    kda, mla = shardings.layers[0], shardings.layers[1]
    assert kda.recurrent_state.spec == P(("expert",), "tensor", None, None)
    assert mla.latent.spec == P(("expert",), None, None)
    assert cache_shardings(jax.eval_shape(lambda: _model(config).init_cache(1, 16)), mesh).lengths.spec == P(None)


def test_router_on_a_mesh_matches_the_reference_router_with_ties():
    config = _config()
    rng = np.random.default_rng(0)
    weight_ED = rng.normal(size=(config.num_experts, config.hidden_size)).astype(np.float32)
    weight_ED[1::2] = weight_ED[0::2]  # experts 2j and 2j+1 always tie
    bias_E = np.zeros(config.num_experts, np.float32)
    bias_E[5] = 0.3
    x_TD = rng.normal(size=(16, config.hidden_size)).astype(np.float32)
    mesh = make_mesh({"expert": 8})
    with jax.set_mesh(mesh):
        x_sharded = jax.device_put(x_TD, jax.sharding.NamedSharding(mesh, P("expert", None)))
        weights, experts = jax.jit(lambda x: route(x, weight_ED, bias_E, config))(x_sharded)
    ref_experts, ref_weights = npr.route(x_TD, weight_ED, bias_E, config.__dict__)
    order = np.argsort(np.asarray(experts), axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), order, -1), ref_experts)
    assert rel_error(np.take_along_axis(np.asarray(weights), order, -1), ref_weights) <= TOL


def _reference_policy(exchange, capacity_factor=None):
    return ExecutionPolicy(kernel_backend="reference", moe_exchange=exchange, moe_capacity_factor=capacity_factor)


def _experts(config, rng):
    e, width, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
    return ExpertWeights(
        *(
            jnp.asarray(rng.normal(size=s).astype(np.float32) * 0.3)
            for s in ((e, width, hidden), (e, width, hidden), (e, hidden, width))
        )
    )


def _routing(config, rng, tokens):
    x_TD = jnp.asarray(rng.normal(size=(tokens, config.hidden_size)).astype(np.float32))
    router = jnp.asarray(rng.normal(size=(config.num_experts, config.hidden_size)).astype(np.float32))
    weights, experts = route(x_TD, router, jnp.zeros(config.num_experts), config)
    return x_TD, weights, experts


def _expert_parallel_case(config, *, seed: int, tokens: int, ep: int):
    """(x, routing weights, experts, expert weights, mesh expert=ep) for moe_parallel."""
    rng = np.random.default_rng(seed)
    x_TD, weights, experts = _routing(config, rng, tokens)
    return x_TD, weights, experts, _experts(config, rng), make_mesh({"expert": ep})


def test_emulated_ragged_all_to_all_follows_the_documented_example():
    """jax.lax.ragged_all_to_all's docstring example (axis of size 2), through the CPU emulation, plus slices
    that land out of order and a device that receives nothing from one source."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("expert",))

    def run(operand, output, *tables):
        call = jax.shard_map(
            lambda *a: emulated_ragged_all_to_all(*a, axis_name="expert"),
            mesh=mesh,
            in_specs=P("expert"),
            out_specs=P("expert"),
            check_vma=False,
        )
        return np.asarray(
            jax.jit(call)(
                jnp.asarray(operand, jnp.float32),
                jnp.zeros(np.size(output)),
                *(jnp.asarray(t, jnp.int32) for t in tables),
            )
        ).reshape(2, -1)

    documented = run([1, 2, 2, 3, 4, 0], [0] * 8, [0, 1, 0, 1], [1, 2, 1, 1], [0, 0, 1, 2], [1, 1, 2, 1])
    np.testing.assert_array_equal(documented, [[1, 3, 0, 0], [2, 2, 4, 0]])
    # device 0 sends [5, 6] to itself at 2 and [7] to device 1 at 0; device 1 sends [8, 9] to device 0 at 0
    # and nothing to itself
    reordered = run([5, 6, 7, 8, 9, 0], [0] * 8, [0, 2, 0, 2], [2, 1, 2, 0], [2, 0, 0, 1], [2, 2, 1, 0])
    np.testing.assert_array_equal(reordered, [[8, 9, 5, 6], [7, 0, 0, 0]])


def test_ragged_slices_per_expert_move_the_same_rows():
    """Each expert's rows cut into 3 slices (some of 0 rows) land exactly where one slice per expert puts them,
    and come back to the same places."""
    config = _config()
    rng = np.random.default_rng(3)
    x_TD, weights, experts = _routing(config, rng, 40)
    ep = 8
    local_experts = config.num_experts // ep
    capacity = rows_per_source(40 // ep, config.num_experts_per_tok, ep, local_experts, None)
    mesh = make_mesh({"expert": ep})

    def exchanged(slices):
        def body(x, w, e):
            routes = ragged_routes(e, ep=ep, local_experts=local_experts, capacity=capacity, slices_per_expert=slices)
            received = ragged_dispatch(x, routes, rows=ep * capacity, native=False)
            back = ragged_return_and_combine(received * 2.0, routes, w, tp_axes=(), dtype=x.dtype, native=False)
            return received, back

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=P("expert"), check_vma=False))(
            x_TD, weights, experts
        )

    (received_1, back_1), (received_3, back_3) = exchanged(1), exchanged(3)
    np.testing.assert_array_equal(np.asarray(received_3), np.asarray(received_1))
    np.testing.assert_array_equal(np.asarray(back_3), np.asarray(back_1))
    expected = 2.0 * np.einsum("tk,td->td", np.asarray(weights), np.asarray(x_TD))  # each row comes back doubled
    assert rel_error(back_1, expected) <= TOL


@pytest.mark.parametrize(
    ("backend", "processes", "expected"),
    [("cpu", 1, "dense"), ("gpu", 1, "ragged"), ("gpu", 2, "dense"), ("tpu", 4, "ragged")],
)
def test_auto_exchange_by_backend_and_process_count(monkeypatch, backend, processes, expected):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    assert resolve_exchange("auto") == expected
    assert resolve_exchange("dense") == "dense" and resolve_exchange("ragged") == "ragged"
    with pytest.raises(ValueError, match="moe_exchange must be one of 'auto', 'ragged', 'dense', got 'sparse'"):
        resolve_exchange("sparse")


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_native_ragged_exchange_lowers_for_tpu_and_cuda(monkeypatch, platform):
    """moe_parallel with the native ragged all-to-all (which XLA:CPU cannot run) lowers for TPU and CUDA from the
    CPU: two ragged all-to-alls (out and back) in the module."""
    monkeypatch.setattr(expert_parallel, "has_ragged_all_to_all", lambda: True)
    config = _config()
    tokens, shape = 64, jax.ShapeDtypeStruct
    e, width, hidden, top_k = config.num_experts, config.moe_intermediate_size, config.hidden_size, 4
    args = (
        shape((tokens, hidden), jnp.bfloat16),
        Routing(shape((tokens, top_k), jnp.float32), shape((tokens, top_k), jnp.int32)),
        ExpertWeights(
            shape((e, width, hidden), jnp.bfloat16),
            shape((e, width, hidden), jnp.bfloat16),
            shape((e, hidden, width), jnp.bfloat16),
        ),
    )
    mesh = make_mesh({"expert": 4}, devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        text = (
            jax.jit(lambda *a: moe_parallel(*a, limit=None, mesh=mesh, policy=_reference_policy("ragged"))[0])
            .trace(*args)
            .lower(lowering_platforms=(platform,))
            .as_text()
        )
    assert text.count("ragged_all_to_all") == 2


EXCHANGE_IDS = ["dense", "ragged"]


@pytest.mark.parametrize("exchange", EXCHANGE_IDS)
@pytest.mark.parametrize("tokens", [24, 3], ids=["all-to-all", "replicated-tokens"])
def test_expert_parallel_equals_dense_baseline(tokens, exchange):
    config = _config()
    rng = np.random.default_rng(1)
    x_TD, weights, experts = _routing(config, rng, tokens)
    params = _experts(config, rng)
    routing = Routing(weights, experts)
    dense = dense_expert_ffn(x_TD, routing, params, 7.0)
    assert (
        rel_error(local_moe(x_TD, routing, params, 7.0, policy=ExecutionPolicy(kernel_backend="reference")), dense)
        <= TOL
    )
    for shape in ({"expert": 8}, {"tensor": 2, "expert": 4}):
        mesh = make_mesh(shape)
        with jax.set_mesh(mesh):
            y, dropped = jax.jit(lambda *a: moe_parallel(*a, limit=7.0, mesh=mesh, policy=_reference_policy(exchange)))(
                x_TD, routing, params
            )
        assert int(dropped) == 0
        assert rel_error(y, dense) <= TOL, shape


def test_ragged_exchange_gradients_match_the_dense_exchange():
    """Training through the (emulated) ragged exchange: gradients w.r.t. the tokens, routing weights and every
    expert weight equal the dense exchange's."""
    config = _config()
    rng = np.random.default_rng(4)
    x_TD, weights, experts = _routing(config, rng, 24)
    params = _experts(config, rng)
    mesh = make_mesh({"expert": 8})
    probe = jnp.asarray(rng.normal(size=(24, config.hidden_size)).astype(np.float32))

    def grads(exchange):
        def loss(x, w, *p):
            y, _ = moe_parallel(
                x, Routing(w, experts), ExpertWeights(*p), limit=7.0, mesh=mesh, policy=_reference_policy(exchange)
            )
            return jnp.sum(y * probe)

        with jax.set_mesh(mesh):
            return jax.jit(jax.grad(loss, argnums=range(5)))(x_TD, weights, *params.stacks)

    for name, ragged, dense in zip(["x", "weights", "gate", "up", "down"], grads("ragged"), grads("dense")):
        assert rel_error(ragged, dense) <= TOL, name


@pytest.mark.parametrize("exchange", EXCHANGE_IDS)
def test_dropless_exchange_in_token_chunks_bounds_the_receive_buffers(monkeypatch, exchange):
    """With ROW_BUFFER_BYTES room for the receive buffers of 5 tokens a device, the 32 tokens of each device go
    through the exchange in 7 chunks (3 padding tokens): the compiled step's temporaries shrink by more than 4x and
    the results are the same bits as in one piece."""
    config, ep = _config(), 8
    x_TD, weights, experts, params, mesh = _expert_parallel_case(config, seed=5, tokens=256, ep=ep)

    def compiled():
        step = functools.partial(moe_parallel, limit=7.0, mesh=mesh, policy=_reference_policy(exchange))
        with jax.set_mesh(mesh):
            return jax.jit(step).lower(x_TD, Routing(weights, experts), params).compile()

    whole = compiled()
    receive_bytes_per_token = ep * config.num_experts_per_tok * config.hidden_size * x_TD.dtype.itemsize
    monkeypatch.setattr(moe_experts, "ROW_BUFFER_BYTES", 5 * receive_bytes_per_token)
    chunked = compiled()
    temp = {name: c.memory_analysis().temp_size_in_bytes for name, c in (("whole", whole), ("chunked", chunked))}
    assert 4 * temp["chunked"] < temp["whole"], temp
    (y_whole, dropped_whole), (y_chunked, dropped_chunked) = (
        c(x_TD, Routing(weights, experts), params) for c in (whole, chunked)
    )
    assert int(dropped_whole) == int(dropped_chunked) == 0
    np.testing.assert_array_equal(y_chunked, y_whole)


@pytest.mark.parametrize("exchange", EXCHANGE_IDS)
def test_capacity_factor_drops_and_reports_exactly_the_overflow(exchange):
    config, tokens, ep = _config(), 64, 8
    x_TD, weights, experts, params, mesh = _expert_parallel_case(config, seed=2, tokens=tokens, ep=ep)
    factor = 0.5
    with jax.set_mesh(mesh):
        y, dropped = jax.jit(
            lambda *a: moe_parallel(*a, limit=None, mesh=mesh, policy=_reference_policy(exchange, factor))
        )(x_TD, Routing(weights, experts), params)
    local_tokens, local_experts = tokens // ep, config.num_experts // ep
    capacity = rows_per_source(local_tokens, config.num_experts_per_tok, ep, local_experts, factor)
    kept = np.ones(experts.shape, bool)
    for shard in range(ep):  # token-major order within each source shard decides who is dropped
        rows = slice(shard * local_tokens, (shard + 1) * local_tokens)
        dest = np.asarray(experts[rows]).reshape(-1) // local_experts
        rank = np.array([np.sum(dest[:i] == d) for i, d in enumerate(dest)])
        kept[rows] = (rank < capacity).reshape(local_tokens, -1)
    assert int(dropped) == int((~kept).sum()) > 0
    expected = dense_expert_ffn(x_TD, Routing(jnp.where(kept, weights, 0.0), experts), params, None)
    assert rel_error(y, expected) <= TOL


def test_moe_sows_expert_load_under_capture():
    config = _config()
    moe = MoE(config, clip_layer=1, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 5, config.hidden_size))
    _, intermediates = nnx.capture(moe, nnx.Intermediate)(x)
    load = intermediates["expert_load"][0]
    assert load.shape == (config.num_experts,) and float(load.sum()) == 10 * config.num_experts_per_tok
    assert int(intermediates["dropped_assignments"][0]) == 0


def test_bad_meshes_give_clear_errors():
    state = nnx.state(_model(_config(num_experts=12, n_group=4, topk_group=2)))
    expected = r"layers\.1\.mlp\.experts\.\w+_proj: dimension 'experts' of size 12.*\('expert',\)"
    with pytest.raises(ShardingError, match=expected):
        param_shardings(state, make_mesh({"expert": 8}))
    with pytest.raises(ShardingError, match="needs 6 devices, but 8"):
        make_mesh({"tensor": 2, "expert": 3})
    with pytest.raises(ShardingError, match="unknown mesh axes"):
        make_mesh({"pipeline": 8})
    with pytest.raises(ShardingError, match="--mesh expects"):
        parse_mesh("tensor:2")
    assert parse_mesh("tensor=2, expert=4") == {"tensor": 2, "expert": 4}
