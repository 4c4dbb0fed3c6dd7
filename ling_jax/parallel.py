"""A model placed on a mesh, with its forward and decode step jitted under explicit in/out shardings.

    mesh = make_mesh({"tensor": 2, "expert": 4})
    sharded = ShardedLM(model, mesh)               # parameters placed by the logical axis rules
    cache = sharded.init_cache(batch, max_length)  # batch over data/fsdp/expert, KDA heads over tensor
    logits, cache = sharded(ids_BT, cache=cache, attention_mask=mask_BT)   # prefill, then decode steps

Each distinct (batch, length, cache) shape compiles once; the cache is donated, so a decode step updates it
in place. Calls trace under `jax.set_mesh(mesh)`, which is what routes the MoE through expert parallelism.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ling_jax.cache import LingCache
from ling_jax.model import LingForCausalLM
from ling_jax.sharding import batch_spec, cache_shardings, param_shardings, shard_model


def _logits_spec(mesh: Mesh, batch: int, vocab: int) -> PartitionSpec:
    tensor = mesh.shape.get("tensor", 1)
    return batch_spec(mesh, batch, None, "tensor" if tensor > 1 and vocab % tensor == 0 else None)


class ShardedLM:
    """`model` (a LingForCausalLM) sharded over `mesh`; call it like the model, get (logits, cache)."""

    def __init__(self, model: LingForCausalLM, mesh: Mesh):
        self.config = model.config
        self.mesh = mesh
        self.dtype = model.dtype
        shard_model(model, mesh)
        self.graphdef, self.params = nnx.split(model)
        self.param_shardings = param_shardings(self.params, mesh)
        self._compiled = {}  # (batch, cache shapes) -> jitted step

    def init_cache(self, batch_size: int, max_length: int) -> LingCache:
        shapes = jax.eval_shape(lambda: LingCache.create(self.config, batch_size, max_length, self.dtype))
        shardings = cache_shardings(shapes, self.mesh)
        return jax.jit(lambda: LingCache.create(self.config, batch_size, max_length, self.dtype),
                       out_shardings=shardings)()

    def _step(self, batch: int, with_cache_of: LingCache | None):
        key = (batch, None if with_cache_of is None else jax.tree.map(lambda a: a.shape, with_cache_of))
        if key not in self._compiled:
            tokens = NamedSharding(self.mesh, batch_spec(self.mesh, batch, None))
            logits = NamedSharding(self.mesh, _logits_spec(self.mesh, batch, self.config.vocab_size))
            graphdef = self.graphdef

            def run(params, cache, ids_BT, mask_BT):
                out = nnx.merge(graphdef, params)(ids_BT, cache=cache, attention_mask=mask_BT)
                return out.logits, out.cache

            if with_cache_of is None:
                fn = jax.jit(lambda params, ids, mask: run(params, None, ids, mask)[0],
                             in_shardings=(self.param_shardings, tokens, tokens), out_shardings=logits)
            else:
                caches = cache_shardings(with_cache_of, self.mesh)
                fn = jax.jit(run, in_shardings=(self.param_shardings, caches, tokens, tokens),
                             out_shardings=(logits, caches), donate_argnums=1)
            self._compiled[key] = fn
        return self._compiled[key]

    def __call__(self, input_ids_BT, *, cache: LingCache | None = None, attention_mask=None):
        """-> logits [B, T, V] (without a cache), or (logits, updated cache) with one (the cache is donated)."""
        ids = jnp.asarray(input_ids_BT, jnp.int32)
        mask = jnp.ones(ids.shape, bool) if attention_mask is None else jnp.asarray(attention_mask, bool)
        with jax.set_mesh(self.mesh):
            if cache is None:
                return self._step(ids.shape[0], None)(self.params, ids, mask)
            return self._step(ids.shape[0], cache)(self.params, cache, ids, mask)
