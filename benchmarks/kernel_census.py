#!/usr/bin/env python3
"""The Pallas kernels in one decode step, counted from its jaxpr on any machine (no device, nothing allocated):
the model is traced on abstract full-size weights with the GPU kernels in interpret mode, and every pallas_call is
counted by name, with the reductions (reduce_sum, ...) that take a kernel's output straight away (a split-K
gemv's partial sums: one extra XLA kernel each on the GPU), and the norms left to XLA (each rsqrt outside a kernel:
an RMSNorm or l2 norm, one fusion or two on the GPU, with the residual add in front where there is one).

    python -m benchmarks.kernel_census                        # the 8-layer Ling-3.1-flash slice, block-FP8, batch 1
    python -m benchmarks.kernel_census --preset ling-3.0-flash --batch 8

It counts launches of the model's own kernels only (XLA's fusions come on top: `benchmarks.generate --profile`
counts every kernel of a real step on the GPU).
"""

from __future__ import annotations

import argparse
import collections
import sys

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend.core import Var, jaxprs_in_params

from benchmarks.common import flash_slice_config
from ling_jax import ExecutionPolicy, LingConfig, preset
from ling_jax.generation.memory_plan import abstract_model

REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin"}
XLA_NORMS = "rsqrt outside kernels"  # kernel_census's count of the norms XLA runs


def kernel_census(jaxpr) -> collections.Counter:
    """{kernel name: pallas_calls} over `jaxpr` (a ClosedJaxpr or Jaxpr) and every jaxpr nested in it, with
    {"NAME -> reduce": reductions reading a NAME kernel's output directly} and {XLA_NORMS: rsqrts outside the
    kernels}."""
    counts = collections.Counter()
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    readers = collections.defaultdict(list)
    for eqn in jaxpr.eqns:
        for var in eqn.invars:
            if isinstance(var, Var):
                readers[var].append(eqn.primitive.name)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            name = eqn.params["name"]
            counts[name] += 1
            reduced = sum(reader in REDUCTIONS for out in eqn.outvars for reader in readers[out])
            if reduced:
                counts[f"{name} -> reduce"] += reduced
            continue
        if eqn.primitive.name == "rsqrt":
            counts[XLA_NORMS] += 1
        for inner in jaxprs_in_params(eqn.params):
            counts += kernel_census(inner)
    return counts


def decode_step(config: LingConfig, *, batch: int = 1, context: int = 64, backend: str = "interpret_gpu"):
    """One decode step (one token a row over a cache of `context` slots) of `config`'s model with block-FP8 weights as
    a checkpoint stores them, traced (`jax.stages.Traced`: abstract weights, nothing allocated) with the kernel
    backend `backend` (the default: the GPU kernels in interpret mode, the GPU path's calls on any machine)."""
    policy = ExecutionPolicy(kernel_backend=backend)
    model = abstract_model(config, weights="stored", dtype=jnp.bfloat16, policy=policy)
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: model.init_cache(batch, context))

    def step(state, ids_BT, cache):
        out = nnx.merge(graphdef, state)(ids_BT, cache=cache)
        return out.logits, out.cache

    return jax.jit(step).trace(state, jax.ShapeDtypeStruct((batch, 1), jnp.int32), cache)


def decode_step_census(config: LingConfig, *, batch: int = 1, context: int = 64) -> collections.Counter:
    """`kernel_census` of one `decode_step` of `config`'s model, the GPU kernels in interpret mode."""
    return kernel_census(decode_step(config, batch=batch, context=context).jaxpr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", help="a whole preset's model instead of the 8-layer Ling-3.1-flash slice")
    parser.add_argument("--batch", type=int, default=1, help="rows of the decode step (default 1)")
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    config = preset(args.preset) if args.preset else flash_slice_config(8, False)
    counts = decode_step_census(config, batch=args.batch)
    layers = config.num_hidden_layers
    norms = counts.pop(XLA_NORMS, 0)
    kernels = sum(n for name, n in counts.items() if " -> " not in name)
    reduces = sum(n for name, n in counts.items() if " -> " in name)
    kinds = " + ".join(f"{n} {kind.upper()}" for kind, n in collections.Counter(config.layer_types).items())
    print(
        f"{layers} layers ({kinds}), batch {args.batch}: {kernels} pallas_calls ({kernels / layers:.1f} a layer), "
        f"{reduces} reductions of a kernel's output ({reduces / layers:.1f} a layer), {norms} norms left to XLA "
        f"({norms / layers:.1f} a layer)"
    )
    print("\n| kernel | calls a step |\n|---|---|")
    for name, n in sorted(counts.items()):
        print(f"| {name} | {n} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
