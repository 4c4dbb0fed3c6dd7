#!/usr/bin/env python3
"""How much a one-layer random-weight model's logits move when a few of its router inputs round one bf16 ulp
the other way: the size of the bf16 differences `scripts/check_multi_gpu.py` can see between two devices that
round a few activations differently (other matmul shapes), with no fault in either.

    python scripts/routing_sensitivity.py --hidden 4096 --experts 64
    python scripts/routing_sensitivity.py --hidden 512 --experts 512

The model is `benchmarks.common.flash_slice_config(1, quick=True)` (one MLA + MoE layer) with the given hidden size
and expert count, the jnp reference path, bf16, on the default device; the prompts are check_multi_gpu's
(8 x 68 tokens, left-padded). For each fraction p, a fixed random p of the router's input elements are scaled
by (1 + 2^-7) (about one bf16 ulp) before the router only; the experts see the unchanged input. Printed: the
rel. error of the real tokens' logits against the unperturbed run (p = 0: no element nudged). One compiled
program runs every p (an argument), and the weights are made by one jitted initialisation.
"""

from __future__ import annotations

import argparse
import sys

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from check_multi_gpu import make_inputs  # noqa: E402
from flax import nnx  # noqa: E402

import ling_jax.moe.block as moe  # noqa: E402
from benchmarks.common import flash_slice_config, init_on_mesh, rel_error  # noqa: E402
from ling_jax import ExecutionPolicy, LingForCausalLM  # noqa: E402
from ling_jax.sharding import make_mesh  # noqa: E402

FRACTIONS = (1e-4, 1e-3, 1e-2)


def perturbing_route(fraction):
    """moe.route with `fraction` (traced) of its input elements nudged up by 2^-7 (relative); none at 0."""
    route = moe.route

    def nudged(x_TD, *args, **kwargs):
        hit = jax.random.uniform(jax.random.key(3), x_TD.shape) < fraction
        x_TD = jnp.where(hit, (x_TD.astype(jnp.float32) * (1 + 2.0**-7)).astype(x_TD.dtype), x_TD)
        return route(x_TD, *args, **kwargs)

    return nudged


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=64)
    args = parser.parse_args(argv)
    config = flash_slice_config(1, True).replace(hidden_size=args.hidden, num_experts=args.experts)
    policy = ExecutionPolicy(kernel_backend="reference")
    model = init_on_mesh(
        lambda: LingForCausalLM(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, policy=policy),
        make_mesh({}, devices=jax.devices()[:1]),
    )
    inputs = make_inputs(config.vocab_size, 8, 64, 4)
    graphdef, state = nnx.split(model)

    @jax.jit
    def logits_at(state, ids, mask, fraction):
        route, moe.route = moe.route, perturbing_route(fraction)  # for this trace only
        try:
            return nnx.merge(graphdef, state)(ids, attention_mask=mask).logits
        finally:
            moe.route = route

    def logits(fraction: float):
        out = logits_at(state, inputs.ids_BL, inputs.mask_BL, jnp.float32(fraction))
        return np.asarray(out, np.float32)[inputs.mask_BL]

    reference = logits(0.0)
    errors = [rel_error(logits(fraction), reference) for fraction in FRACTIONS]
    print(
        f"hidden {args.hidden}, {args.experts} experts, one MLA + MoE layer, bf16: logits rel. error with p of the "
        "router inputs one ulp off: " + ", ".join(f"p {p:g}: {e:.2e}" for p, e in zip(FRACTIONS, errors))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
