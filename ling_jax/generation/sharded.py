"""A model placed on a mesh, with its forward and decode step jitted under explicit in/out shardings.

    mesh = make_mesh({"tensor": 2, "expert": 4})
    sharded = ShardedLM(model, mesh)               # parameters placed by the logical axis rules
    cache = sharded.init_cache(batch, max_length)  # batch over data/fsdp/expert, KDA heads over tensor
    logits, cache = sharded(ids_BT, cache=cache, attention_mask=mask_BT)   # prefill, then decode steps

Each distinct (batch, length, cache) shape compiles once; the cache is donated, so a decode step updates it
in place. Calls trace under `jax.set_mesh(mesh)` (which is what routes the MoE through expert parallelism) and
`use_rules(rules)`: `ShardedLM(model, mesh, rules={**RULES, "experts": (...)})` moves the parameters, the
activation constraints and the expert-parallel collectives together.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from ling_jax.cache import LingCache
from ling_jax.model import LingForCausalLM
from ling_jax.sharding import (
    Rules,
    activation_spec,
    cache_shardings,
    check_rules,
    current_rules,
    param_shardings,
    shard_model,
    use_rules,
)


class ShardedLM:
    """`model` (a LingForCausalLM) sharded over `mesh`; call it like the model, get (logits, cache).

    rules: the logical axis rules (default: those in effect here, `ling_jax.sharding.RULES` unless inside
    `use_rules`), used for the parameters, the cache, the inputs and outputs and everything traced inside."""

    def __init__(self, model: LingForCausalLM, mesh: Mesh, rules: Rules | None = None):
        self.config = model.config
        self.mesh = mesh
        self.rules = check_rules(current_rules() if rules is None else rules)
        self.dtype = model.dtype
        shard_model(model, mesh, self.rules)
        self.graphdef, self.params = nnx.split(model)
        self.param_shardings = param_shardings(self.params, mesh, self.rules)
        self._compiled = {}  # (batch, length, cache shapes) -> jitted step

    @contextlib.contextmanager
    def _context(self):
        with jax.set_mesh(self.mesh), use_rules(self.rules):
            yield

    def init_cache(self, batch_size: int, max_length: int) -> LingCache:
        shapes = jax.eval_shape(lambda: LingCache.create(self.config, batch_size, max_length, self.dtype))
        shardings = cache_shardings(shapes, self.mesh, self.rules)
        return jax.jit(
            lambda: LingCache.create(self.config, batch_size, max_length, self.dtype), out_shardings=shardings
        )()

    def _step(self, batch: int, length: int, with_cache_of: LingCache | None):
        key = (batch, length, None if with_cache_of is None else jax.tree.map(lambda a: a.shape, with_cache_of))
        if key not in self._compiled:

            def sharding(logical, shape):
                return NamedSharding(self.mesh, activation_spec(logical, shape, self.mesh, rules=self.rules))

            tokens = sharding(("activation_batch", "activation_length"), (batch, length))
            logits = sharding(
                ("activation_batch", "activation_length", "activation_vocab"), (batch, length, self.config.vocab_size)
            )
            graphdef = self.graphdef

            def run(params, cache, ids_BT, mask_BT):
                out = nnx.merge(graphdef, params)(ids_BT, cache=cache, attention_mask=mask_BT)
                return out.logits, out.cache

            if with_cache_of is None:
                fn = jax.jit(
                    lambda params, ids, mask: run(params, None, ids, mask)[0],
                    in_shardings=(self.param_shardings, tokens, tokens),
                    out_shardings=logits,
                )
            else:
                caches = cache_shardings(with_cache_of, self.mesh, self.rules)
                fn = jax.jit(
                    run,
                    in_shardings=(self.param_shardings, caches, tokens, tokens),
                    out_shardings=(logits, caches),
                    donate_argnums=1,
                )
            self._compiled[key] = fn
        return self._compiled[key]

    def __call__(self, input_ids_BT, *, cache: LingCache | None = None, attention_mask=None):
        """-> logits [B, T, V] (without a cache), or (logits, updated cache) with one (the cache is donated)."""
        ids, mask = _tokens(input_ids_BT, attention_mask)
        with self._context():
            if cache is None:
                return self._step(*ids.shape, None)(self.params, ids, mask)
            return self._step(*ids.shape, cache)(self.params, cache, ids, mask)

    def lower(self, input_ids_BT, *, attention_mask=None) -> jax.stages.Lowered:
        """The cache-free forward for these inputs, lowered: `.as_text()` shows the program (its named scopes in
        the op locations with `debug_info=True`), `.compile()` what XLA made of the rules; the compiled program
        takes (self.params, ids, mask)."""
        ids, mask = _tokens(input_ids_BT, attention_mask)
        with self._context():
            return self._step(*ids.shape, None).lower(self.params, ids, mask)


def _tokens(input_ids_BT, attention_mask):
    ids = jnp.asarray(input_ids_BT, jnp.int32)
    return ids, jnp.ones(ids.shape, bool) if attention_mask is None else jnp.asarray(attention_mask, bool)
