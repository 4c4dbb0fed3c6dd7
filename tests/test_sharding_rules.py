"""The logical rules drive the whole program: no mesh-axis name outside ling_jax/sharding.py, one changed rule
moves parameters and collectives together (8 virtual CPU devices), activation constraints, named scopes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import rel_error
from jax.sharding import PartitionSpec as P

from ling_jax import LingForCausalLM
from ling_jax.generation.sharded import ShardedLM
from ling_jax.moe.block import route
from ling_jax.moe.expert_parallel import moe_parallel
from ling_jax.moe.experts import dense_expert_ffn
from ling_jax.policy import ExecutionPolicy
from ling_jax.presets import preset
from ling_jax.sharding import (
    ACTIVATION_BTD,
    MESH_AXES,
    RULES,
    ShardingError,
    constrain,
    make_mesh,
    use_rules,
)
from pallas_kernels.moe.ops import ExpertWeights, Routing

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ling_jax", "convert", "pallas_kernels")
SHARDING_MODULE = ROOT / "ling_jax" / "sharding.py"
# calls whose arguments name mesh axes: partition specs, shardings, constraints, shard_map and the collectives
AXIS_CALLS = {
    "P",
    "PartitionSpec",
    "NamedSharding",
    "with_sharding_constraint",
    "reshard",
    "shard_map",
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "psum_scatter",
    "all_to_all",
    "ragged_all_to_all",
    "all_gather",
    "axis_index",
    "axis_size",
    "ppermute",
    "pshuffle",
}
AXIS_KEYWORDS = {"axis_name", "axis_names"}


def _is_axis(node) -> bool:
    return isinstance(node, ast.Constant) and node.value in MESH_AXES


def _called_name(func) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _reads_mesh_shape(node) -> bool:
    """mesh.shape["expert"] or mesh.shape.get("expert", 1)."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.value, ast.Attribute) and node.value.attr == "shape" and _is_axis(node.slice)
    func = node.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "get"
        and isinstance(func.value, ast.Attribute)
        and func.value.attr == "shape"
        and any(_is_axis(a) for a in node.args)
    )


def _names_axes(target) -> bool:
    return isinstance(target, ast.Name) and target.id.endswith(("axis", "axes"))


def axis_literals(source: str) -> list[tuple[int, str]]:
    """(line, axis) for each mesh-axis name written as a string where it is used as a mesh axis: anywhere inside
    the arguments of a call in AXIS_CALLS, as an axis_name= keyword, as the key of a `.shape` read, or in the value
    given to a variable named *_axis / *_axes. Strings elsewhere (docstrings, messages, a CLI flag's table, the
    `unit=` of a progress bar, numpy's `__array_interface__["data"]`) are not axis usages."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(_names_axes(t) for t in node.targets):
            found += [(c.lineno, c.value) for c in ast.walk(node.value) if _is_axis(c)]
        if isinstance(node, ast.Call) and _called_name(node.func) in AXIS_CALLS:
            args = [*node.args, *(k.value for k in node.keywords)]
            found += [(c.lineno, c.value) for a in args for c in ast.walk(a) if _is_axis(c)]
        elif isinstance(node, ast.Call):
            found += [
                (c.lineno, c.value)
                for k in node.keywords
                if k.arg in AXIS_KEYWORDS
                for c in ast.walk(k.value)
                if _is_axis(c)
            ]
        if isinstance(node, (ast.Subscript, ast.Call)) and _reads_mesh_shape(node):
            found.append((node.lineno, "shape read"))
    return sorted(set(found))


def test_the_axis_literal_scan_finds_axis_usages_only():
    bad = """
spec = P(("expert", "data"), None)
total = jax.lax.psum(x, ("tensor",))
y = jax.lax.ragged_all_to_all(a, b, c, d, e, f, axis_name="fsdp")
ep = mesh.shape.get("expert", 1)
tp_axes = ("tensor",) if tp > 1 else ()
"""
    benign = '''
"""Experts split over the `expert` axis."""
shape = {"data": 2}
address = view.__array_interface__["data"][0]
raise ValueError("cannot split over 'tensor'")
bar = tqdm(plan, unit="tensor")
for flag, axis, size in (("--tp", "tensor", args.tp),):
    pass
'''
    assert [line for line, _ in axis_literals(bad)] == [2, 2, 3, 4, 5, 6]
    assert axis_literals(benign) == []


def test_no_mesh_axis_literal_outside_the_sharding_module():
    """Every mesh axis the package uses comes from the rules (`ling_jax.sharding.mesh_axes` & co.): a name written
    by hand elsewhere would not follow a changed rule."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {axis}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if path != SHARDING_MODULE
        for line, axis in axis_literals(path.read_text())
    ]
    assert not offenders, "mesh axes named outside ling_jax/sharding.py:\n" + "\n".join(offenders)


def test_constrain_follows_the_rules_and_is_a_no_op_without_a_mesh():
    x_BTD = jnp.ones((8, 3, 64))
    assert constrain(x_BTD, *ACTIVATION_BTD) is x_BTD
    mesh = make_mesh({"tensor": 2, "expert": 4})

    def spec(x, rules=RULES):
        with jax.set_mesh(mesh), use_rules(rules):
            return jax.jit(lambda a: constrain(a * 2, *ACTIVATION_BTD))(x).sharding.spec

    assert spec(x_BTD) == P("expert")  # (trailing replicated dimensions are left out of a result's spec)
    embed_split = {**RULES, "activation_embed": ("tensor",)}
    assert spec(x_BTD, embed_split) == P("expert", None, "tensor")
    assert spec(x_BTD[:1], embed_split) == P(None, None, "tensor")  # a batch of one stays whole
    with pytest.raises(ShardingError, match="do not match an array of shape"):
        spec(x_BTD[0])
    with (
        pytest.raises(ShardingError, match="rule 'experts': expected a tuple of distinct mesh axes"),
        use_rules({**RULES, "experts": ("pipeline",)}),
    ):
        pass


EXPERTS_OVER_EXPERT_AND_DATA = {**RULES, "experts": ("expert", "data")}


@pytest.fixture(scope="module")
def changed_rule():
    """A two-layer tiny model (KDA + dense MLP, MLA + MoE) on a data=2 x expert=4 mesh with the experts split over
    expert x data (8 ways, instead of 4 ways and replicated over data), its unsharded logits, and the lowered
    forward (one sharded compile for the module)."""
    config = preset("tiny").replace(num_hidden_layers=2, layer_types=("kda", "mla"), mlp_layer_types=("dense", "moe"))
    model = LingForCausalLM(config, rngs=nnx.Rngs(0), dtype=jnp.float32)
    ids = jax.random.randint(jax.random.key(1), (8, 7), 0, config.vocab_size)
    mask = np.ones(ids.shape, bool)
    mask[3, :4] = False
    graphdef, state = nnx.split(model)
    full = jax.jit(lambda s, i, m: nnx.merge(graphdef, s)(i, attention_mask=m).logits)(state, ids, mask)
    sharded = ShardedLM(model, make_mesh({"data": 2, "expert": 4}), rules=EXPERTS_OVER_EXPERT_AND_DATA)
    return config, sharded, ids, mask, np.asarray(full), sharded.lower(ids, attention_mask=mask)


def _all_to_all_groups(hlo: str) -> list[list[int]]:
    groups = re.findall(r"all-to-all\(.*replica_groups=\{(\{[\d,]+\}(?:,\{[\d,]+\})*)\}", hlo)
    return [[int(d) for d in group.split(",")] for text in groups for group in re.findall(r"\{([\d,]+)\}", text)]


def test_a_changed_rule_moves_the_experts_and_their_exchange(changed_rule):
    config, sharded, ids, mask, full, lowered = changed_rule
    hlo = lowered.compile().as_text()
    assert rel_error(sharded(ids, attention_mask=mask), full) <= 1e-5
    gate = nnx.merge(sharded.graphdef, sharded.params).model.layers[1].mlp.experts.gate_proj[...]
    assert {shard.data.shape[0] for shard in gate.addressable_shards} == {config.num_experts // 8}
    assert len({shard.index[0].start for shard in gate.addressable_shards}) == 8
    groups = _all_to_all_groups(hlo)
    # rows out, their expert ids, results back: each across all 8 devices (two groups of 4 by default)
    assert len(groups) == 3 and all(sorted(group) == list(range(8)) for group in groups), groups


def test_blocks_run_under_named_scopes(changed_rule):
    text = changed_rule[-1].as_text(debug_info=True)
    scopes = [
        "decoder_layer_0/kda",
        "decoder_layer_0/mlp",
        "decoder_layer_1/mla",
        "decoder_layer_1/moe/moe_router",
        "decoder_layer_1/moe/routed_experts",
        "decoder_layer_1/moe/shared_expert",
        "lm_head",
    ]
    assert [scope for scope in scopes if scope not in text] == []


@pytest.mark.parametrize("tokens", [24, 2, 3], ids=["split-over-both", "split-over-data-only", "replicated"])
def test_experts_over_two_axes_match_the_dense_baseline(tokens):
    """Experts over expert x data: tokens split over both axes, over one of them (the exchange then runs on
    duplicated tokens) or over neither (partial sums over both)."""
    config = preset("tiny")
    rng = np.random.default_rng(5)
    e, width, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
    gate, up, down = (
        jnp.asarray(rng.normal(size=s).astype(np.float32) * 0.3)
        for s in ((e, width, hidden), (e, width, hidden), (e, hidden, width))
    )
    x_TD = jnp.asarray(rng.normal(size=(tokens, hidden)).astype(np.float32))
    router_ED = jnp.asarray(rng.normal(size=(e, hidden)).astype(np.float32))
    policy = ExecutionPolicy(kernel_backend="reference")
    routing = Routing(*route(x_TD, router_ED, jnp.zeros(e), config, policy=policy))
    stacks = ExpertWeights(gate, up, down)
    mesh = make_mesh({"data": 2, "expert": 4})
    with jax.set_mesh(mesh), use_rules(EXPERTS_OVER_EXPERT_AND_DATA):
        y, dropped = jax.jit(lambda *a: moe_parallel(*a, limit=7.0, mesh=mesh, policy=policy))(x_TD, routing, stacks)
    assert int(dropped) == 0
    assert rel_error(y, dense_expert_ffn(x_TD, routing, stacks, 7.0)) <= 1e-5
