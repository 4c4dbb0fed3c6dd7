"""Routed experts for a few tokens (decode) on GPU: two Pallas kernels (Triton lowering), no sorting.

At decode sizes each token-expert pair is its own group, so the grouped path's sort, row tiling, gather and
scatter cost more than the arithmetic. Here every row r = (token t, slot k) reads its expert's weights directly:

- `_swiglu_kernel`, program (row, column tile of the expert width I): gate and up tiles of expert e_r times
  x[t] (products summed over the hidden size in chunks, fp32, both tiles of a chunk loaded before either is
  used), SwiGLU with the optional clip, stored to h[r];
- `_down_combine_kernel`, program (token, column tile of the hidden size D): the down tiles of the token's
  experts e_(t,k) times h[(t,k)], weighted by the routing weights and summed over k (the combine) in fp32, every
  expert's tile of a K step loaded before any is used (one memory round trip a step, not one an expert: at one
  token the kernel is a chain of such round trips).

Both are streams of expert weights (tokens x top_k x 3 x D x I elements), read once per row: the right
choice while rows rarely share an expert, i.e. for a few tokens; the grouped path reads each expert once.
A row whose expert is outside [0, E) contributes nothing and reads no weights. Each weight is read through a
weight-tile loader (`weight_tiles`): dense here, block FP8 or MXFP4 for the weight-only variant (`weight_only`,
the same entry point, refusing dense weights).

With `shared` weights (the MoE's shared expert, of the same width I), each token gets one more row, after
the routed ones, that reads the shared weights (a one-expert stack) with weight 1: the shared expert costs no
launches of its own and its output is summed with the routed ones in fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.moe import tuned
from pallas_kernels.moe.gpu_triton.weight_tiles import Dense, expert_tiles, kernel_operands, weight_format
from pallas_kernels.moe.reference import swiglu
from pallas_kernels.triton_masked import masked_load
from pallas_kernels.tuning import fill, lookup


def _valid(expert, num_experts: int):
    """1 if 0 <= expert < num_experts else 0, as int32 (clips: Triton's lowering turns a where of two
    constants into i1)."""
    return jnp.clip(expert + 1, 0, 1) * jnp.clip(num_experts - expert, 0, 1)


def _tile_products(terms, steps, *, col0, block_n: int, block_k: int, k_dim: int, mask_k: bool, first=0):
    """[sum_j weight[expert, col0 + n, j] * vector[row, j] for n < block_n] (fp32 [block_n]) for each term (weight
    tiles, expert, rows_ok_N: the rows read (None: all), vector ref, its row), over `steps` K steps (0: no reads)
    from step `first`. Each step loads every term's tile and vector chunk before using any: one memory round trip a
    step for all of them (a quantised weight's tiles dequantised on chip)."""

    def body(step, accs):
        k0 = (first + step) * block_k
        k_ok = k0 + jnp.arange(block_k) < k_dim if mask_k else None
        tiles = [
            weight.load(
                expert, col0, k0, block_n=block_n, block_k=block_k, cols_ok_N=rows_ok, k_ok_K=k_ok, dtype=jnp.float32
            )
            for weight, expert, rows_ok, _, _ in terms
        ]
        chunks = [masked_load(ref.at[row, pl.ds(k0, block_k)], k_ok) for _, _, _, ref, row in terms]
        return tuple(
            acc_N + jnp.sum(tile_NK * chunk_K.astype(jnp.float32)[None, :], axis=1)
            for acc_N, tile_NK, chunk_K in zip(accs, tiles, chunks)
        )

    zeros = tuple(jnp.zeros((block_n,), jnp.float32) for _ in terms)
    return jax.lax.fori_loop(0, steps, body, zeros)


def _grouped_products(terms, steps, in_flight: int, **keywords) -> list:
    """`_tile_products` of `terms` in groups of in_flight (0: all together), one loop a group after the other."""
    size = in_flight or len(terms)
    return [p for i in range(0, len(terms), size) for p in _tile_products(terms[i : i + size], steps, **keywords)]


def _swiglu_kernel(
    expert_ref,
    x_ref,
    *refs,
    formats,
    top_k: int,
    routed_rows: int,
    limit: float | None,
    shared_limit: float | None,
    in_flight: int,
    splits: int,
    block_n: int,
    block_k: int,
    mask_n: bool,
    mask_k: bool,
):
    """Row r < routed_rows is (token r // top_k, its expert); with shared refs, row routed_rows + t is token t's
    shared-expert row (its routed expert index is -1: no routed reads)."""
    *weight_refs, h_ref = refs
    if splits != 1:
        raise ValueError(f"the SwiGLU row kernel sums its whole K range in one program (splits 1), got {splits}")
    gate, up, *shared = expert_tiles(weight_refs, formats)
    row, col0 = pl.program_id(0), pl.program_id(1) * block_n
    cols_ok = col0 + jnp.arange(block_n) < gate.shape[1] if mask_n else None
    is_shared = jnp.clip(row - routed_rows + 1, 0, 1)  # int 0 / 1 (see _valid)
    token = row // top_k + is_shared * (row - routed_rows - row // top_k)
    steps = pl.cdiv(gate.shape[2], block_k)
    products = functools.partial(
        _grouped_products,
        in_flight=in_flight,
        col0=col0,
        block_n=block_n,
        block_k=block_k,
        k_dim=gate.shape[2],
        mask_k=mask_k,
    )
    expert = expert_ref[...] * (1 - is_shared) - is_shared  # a shared row read the last routed slot: -1 instead
    routed_steps = _valid(expert, gate.shape[0]) * steps  # 0: a shared row reads no routed weights
    gate_N, up_N = products([(gate, expert, cols_ok, x_ref, token), (up, expert, cols_ok, x_ref, token)], routed_steps)
    hidden = swiglu(gate_N, up_N, limit)
    if shared:
        shared_gate, shared_up = shared
        shared_terms = [
            (shared_gate, jnp.int32(0), cols_ok, x_ref, token),
            (shared_up, jnp.int32(0), cols_ok, x_ref, token),
        ]
        shared_gate_N, shared_up_N = products(shared_terms, is_shared * steps)  # 0 steps on a routed row
        gate_N, up_N = gate_N + shared_gate_N, up_N + shared_up_N
        hidden = jnp.where(is_shared == 1, swiglu(gate_N, up_N, shared_limit), swiglu(gate_N, up_N, limit))
    plgpu.store(h_ref.at[row, pl.ds(col0, block_n)], hidden.astype(h_ref.dtype), mask=cols_ok)


def _down_combine_kernel(
    expert_ref,
    weight_ref,
    h_ref,
    *refs,
    formats,
    top_k: int,
    routed_rows: int,
    in_flight: int,
    splits: int,
    block_n: int,
    block_k: int,
    mask_n: bool,
    mask_k: bool,
):
    """Program (token, column tile, split): loops over its split of the width I whose every step loads the tile of each
    of in_flight of the token's experts (its top_k slots, then the shared expert's; 0: all in one loop) before using
    any: the experts' bytes in flight together, one memory round trip a step for the group rather than one an expert.
    In a group an invalid slot's rows are masked (no reads) and its routing weight zeroed, the loads of a program
    whose slots are all valid left unmasked (a second form of the loop, picked by a branch); one expert at a time
    (in_flight 1), an invalid slot's loop runs no steps and the rows are masked only at the weight's edge (row masks
    on every load cost ~13% at 8 tokens on an H100). y [splits, tokens, D]: each split's sums (fp32 where splits >
    1), for the caller to add in split order."""
    *weight_refs, y_ref = refs
    down, *shared = expert_tiles(weight_refs, formats)
    num_experts, n_dim, k_dim = down.shape
    token, col0, split = pl.program_id(0), pl.program_id(1) * block_n, pl.program_id(2)
    edge_ok = col0 + jnp.arange(block_n) < n_dim if mask_n else None
    cols_ok = col0 + jnp.arange(block_n) < n_dim
    all_steps = pl.cdiv(k_dim, block_k)
    split_steps = pl.cdiv(all_steps, splits)
    first = split * split_steps
    # a split's K steps: a constant where they divide evenly (the one-split kernel's loop as before)
    steps = split_steps if all_steps % splits == 0 else jnp.clip(all_steps - first, 0, split_steps)
    terms, term_steps = [], []  # (weight tiles, expert read (in range), its rows' mask, h's row, routing weight)
    for slot in range(top_k):
        expert = expert_ref[slot]  # scalar loads, all issued together: no cross-thread sums before the weights
        valid = _valid(expert, num_experts)
        weight = weight_ref[slot].astype(jnp.float32) * valid.astype(jnp.float32)
        in_range = jnp.clip(expert, 0, num_experts - 1)
        rows_ok = edge_ok if in_flight == 1 else cols_ok & (valid == 1)
        terms.append((down, in_range, rows_ok, token * top_k + slot, weight))
        term_steps.append(valid * steps)
    if shared:
        terms.append((shared[0], jnp.int32(0), edge_ok if in_flight == 1 else cols_ok, routed_rows + token, 1.0))
        term_steps.append(steps)

    keywords = dict(col0=col0, block_n=block_n, block_k=block_k, k_dim=k_dim, mask_k=mask_k, first=first)
    reads = [(tiles_of, expert, rows_ok, h_ref, row) for tiles_of, expert, rows_ok, row, _ in terms]
    if in_flight == 1:
        products = [_tile_products([read], n, **keywords)[0] for read, n in zip(reads, term_steps)]
    else:  # the row masks only where a slot is invalid (expert-parallel shards): unmasked loads are faster
        unmasked = [(tiles_of, expert, edge_ok, ref, row) for tiles_of, expert, _, ref, row in reads]
        all_valid = functools.reduce(jnp.minimum, term_steps) > 0
        products = jax.lax.cond(
            all_valid,
            lambda: tuple(_grouped_products(unmasked, steps, in_flight, **keywords)),
            lambda: tuple(_grouped_products(reads, steps, in_flight, **keywords)),
        )
    acc_N = sum(weight * product_N for (*_, weight), product_N in zip(terms, products))
    plgpu.store(y_ref.at[split, token, pl.ds(col0, block_n)], acc_N.astype(y_ref.dtype), mask=edge_ok)


def _tile(size: int, wanted: int) -> int:
    return min(wanted, pl.next_power_of_2(size))


def _row_call(kernel, tiles: tuple, operands, per_row_specs, out_shape, *, k_dim: int, interpret: bool, name: str):
    """pallas_call of kernel(*operand_refs, out_ref, in_flight=, splits=, block_n=, block_k=, mask_n=, mask_k=) over
    the grid (row of out [..., rows, N], column tile of N, split of K): tiles (block_n, block_k, num_warps,
    num_stages, in_flight, splits), the blocks fitted to N and k_dim (`_tile`); per_row_specs: the BlockSpecs of
    the first operands (indexed by row and column tile), the others whole."""
    rows, n_dim = out_shape.shape[-2:]
    block_n, block_k, num_warps, num_stages, in_flight, splits = tiles
    block_n, block_k = _tile(n_dim, block_n), _tile(k_dim, block_k)
    whole = lambda dims: pl.BlockSpec(dims, lambda *_: (0,) * len(dims))  # noqa: E731
    return pl.pallas_call(
        functools.partial(
            kernel,
            in_flight=in_flight,
            splits=splits,
            block_n=block_n,
            block_k=block_k,
            mask_n=n_dim % block_n != 0,
            mask_k=k_dim % block_k != 0,
        ),
        grid=(rows, pl.cdiv(n_dim, block_n), splits),
        in_specs=[*per_row_specs, *(whole(a.shape) for a in operands[len(per_row_specs) :])],
        out_specs=whole(out_shape.shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*operands)


def launch_tiles(dense: bool, tokens: int, dtype, swiglu_tiles: tuple, down_tiles: tuple) -> tuple[tuple, tuple]:
    """(SwiGLU, down) kernels' (block_n, block_k, num_warps, num_stages, in_flight, splits): the given ones, None
    ones and those not given from `tuned.ROUTED_SWIGLU` / `tuned.ROUTED_DOWN` (dense experts) or their *_QUANTIZED
    tables, by `tuned.tokens_bucket`."""
    swiglu_table, down_table = (
        (tuned.ROUTED_SWIGLU, tuned.ROUTED_DOWN)
        if dense
        else (tuned.ROUTED_SWIGLU_QUANTIZED, tuned.ROUTED_DOWN_QUANTIZED)
    )
    bucket = tuned.tokens_bucket(tokens)
    return (
        fill(swiglu_tiles, lookup(swiglu_table, dtype=dtype, bucket=bucket)),
        fill(down_tiles, lookup(down_table, dtype=dtype, bucket=bucket)),
    )


def _kernel_weights(weights, names):
    """(formats, the kernel's operands, read as stored) of weights named `names`: the routed ones [E, ...] as
    they are, the shared expert's (names "shared ...") as one-expert stacks [1, ...]."""
    formats, operands = [], []
    for weight, name in zip(weights, names):
        formats.append(weight_format(weight, name))
        arrays = kernel_operands(weight, formats[-1], name=name)
        operands += [a[None] for a in arrays] if name.startswith("shared") else arrays
    return tuple(formats), operands


@functools.partial(
    jax.jit, static_argnames=("limit", "shared_limit", "interpret", "swiglu_tiles", "down_tiles", "split_sums")
)
def routed_experts_gpu(
    x_TD,
    weights_TK,
    experts_TK,
    gate_EID,
    up_EID,
    down_EDI,
    shared=None,
    *,
    limit: float | None,
    shared_limit: float | None = None,
    interpret: bool = False,
    swiglu_tiles: tuple[int | None, ...] = (),
    down_tiles: tuple[int | None, ...] = (),
    split_sums: bool = False,
):
    """sum_k weights[t, k] * FFN_{experts[t, k]}(x[t]) -> [T, D] in x's dtype (fp32 accumulation), where FFN_e
    is expert e's SwiGLU (clipped at `limit`). Weights are read as stored (`weight_tiles`: a quantised tile
    dequantised on chip); experts outside [0, E) contribute nothing. shared: None, or the shared expert's (gate
    [I, D], up [I, D], down [D, I], in a format of its own), clipped at `shared_limit`, added with weight 1.
    Tiles: (block_n, block_k, num_warps, num_stages, in_flight, splits) of each kernel (`tuned.RowTiles`), the blocks
    powers of two; None ones and those not given from the tuned tables (`launch_tiles`). split_sums: the down
    kernel's splits of the width unsummed, [S, T, D] (fp32 where S > 1, else x's dtype), for the norm after the
    layer to add (`pallas_kernels.norm.add_partials_rms_norm`)."""
    tokens, hidden = x_TD.shape
    top_k = experts_TK.shape[1]
    width = gate_EID.shape[1]
    routed_rows = tokens * top_k
    shared = () if shared is None else tuple(shared)
    if shared and tuple(shared[0].shape) != tuple(gate_EID.shape[1:]):
        raise ValueError(
            f"shared expert gate {tuple(shared[0].shape)} must have the routed experts' shape "
            f"{tuple(gate_EID.shape[1:])} to run in their kernels"
        )
    swiglu_formats, swiglu_weights = _kernel_weights(
        (gate_EID, up_EID, *shared[:2]), ("gate", "up", "shared gate", "shared up")
    )
    down_formats, down_weights = _kernel_weights((down_EDI, *shared[2:]), ("down", "shared down"))
    dense = all(isinstance(f, Dense) for f in swiglu_formats[:2] + down_formats[:1])
    swiglu_tiles, down_tiles = launch_tiles(dense, tokens, x_TD.dtype, swiglu_tiles, down_tiles)
    rows = routed_rows + (tokens if shared else 0)
    experts_R = experts_TK.reshape(-1).astype(jnp.int32)
    h_RI = _row_call(
        functools.partial(
            _swiglu_kernel,
            formats=swiglu_formats,
            top_k=top_k,
            routed_rows=routed_rows,
            limit=limit,
            shared_limit=shared_limit,
        ),
        swiglu_tiles,
        (experts_R, x_TD, *swiglu_weights),
        [pl.BlockSpec((None,), lambda r, n, s: (jnp.minimum(r, routed_rows - 1),))],
        jax.ShapeDtypeStruct((rows, width), x_TD.dtype),
        k_dim=hidden,
        interpret=interpret,
        name="expert_swiglu_rows",
    )

    slots = pl.next_power_of_2(top_k)  # Triton blocks are powers of two: pad the slots with invalid experts
    experts_TS = jnp.pad(experts_TK.astype(jnp.int32), ((0, 0), (0, slots - top_k)), constant_values=-1)
    weights_TS = jnp.pad(weights_TK.astype(jnp.float32), ((0, 0), (0, slots - top_k)))
    per_token = pl.BlockSpec((None, slots), lambda t, n, s: (t, 0))
    splits = down_tiles[5]
    y_STD = _row_call(
        functools.partial(_down_combine_kernel, formats=down_formats, top_k=top_k, routed_rows=routed_rows),
        down_tiles,
        (experts_TS, weights_TS, h_RI, *down_weights),
        [per_token, per_token],
        jax.ShapeDtypeStruct((splits, tokens, hidden), x_TD.dtype if splits == 1 else jnp.float32),
        k_dim=width,
        interpret=interpret,
        name="expert_down_combine",
    )
    if split_sums:
        return y_STD
    return y_STD[0] if splits == 1 else jnp.sum(y_STD, axis=0).astype(x_TD.dtype)
