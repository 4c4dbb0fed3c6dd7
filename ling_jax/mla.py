"""Gated multi-head latent attention (spec §3): expanded form for prefill, absorbed latent form for decode.

Both forms read and write the same latent cache, [c_kv (kv_lora_rank) ; k_pe (qk_rope_head_dim)] per token
(576 values for Ling; layout in `ling_jax.cache`). They differ only in where W_UK / W_UV are applied.
`latent_attention(weights, x_BTD, cache, ctx, cfg)` is the layer as a pure function, the cache write included;
`MultiLatentAttention` holds the parameters and calls its parts.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.cache import MLAState, PagedMLAState
from ling_jax.config import LingConfig
from ling_jax.context import KeyVisibility, TokenContext
from ling_jax.layers import Linear, RMSNorm, Weights, linear, linear_many, params_of, rms_norm
from ling_jax.policy import ExecutionPolicy, MLAMode, as_policy, op_backend
from ling_jax.quantized import dequantized, is_quantized
from ling_jax.rope import apply_rope, softmax_scale
from ling_jax.sharding import per_shard
from pallas_kernels.mla.ops import (
    absorb_query,
    expand_output,
    mla_decode,
    mla_decode_paged,
    mla_decode_tokens,
    mla_prefill,
)
from pallas_kernels.mla.reference import absorbed_attention, gather_pages

EXPANDED = MLAMode.EXPANDED
ABSORBED = MLAMode.ABSORBED

# logical axes of the kernels' arrays: each sequence and each head is independent (`per_shard`); the B * T query
# rows of absorb_query / expand_output split like a batch
_BTHD = ("activation_batch", None, "heads", None)
_BHD = ("activation_batch", "heads", None)
_BSA = ("activation_batch", None, None)
_BN = ("activation_batch", None)
_HCR = ("heads", None, None)


def _first_query_proj(cfg: LingConfig) -> str:
    """The query's projection of x: q_proj, or q-LoRA's down projection q_a_proj."""
    return "q_proj" if cfg.q_lora_rank is None else "q_a_proj"


def _queries(weights: Weights, q_first, cos, sin, cfg: LingConfig, policy: ExecutionPolicy):
    """(q_nope, q_pe after RoPE) [B, T, H, *] from q_first, x's `_first_query_proj` product."""
    c = cfg
    q = q_first
    if c.q_lora_rank is not None:
        q = linear(weights["q_b_proj"], rms_norm(weights["q_a_layernorm"], q_first, c.rms_norm_eps), policy)
    q_BTHQ = q.reshape(*q_first.shape[:2], c.num_attention_heads, c.qk_head_dim)
    q_nope, q_pe = q_BTHQ[..., : c.qk_nope_head_dim], q_BTHQ[..., c.qk_nope_head_dim :]
    return q_nope, apply_rope(q_pe, cos, sin, interleave=c.rope.interleave)


def mla_latent(weights: Weights, x_BTD, cos, sin, cfg: LingConfig, policy: ExecutionPolicy | None = None) -> jax.Array:
    """The per-token cache entry [c_kv after kv_a_layernorm ; k_pe after RoPE], [B, T, latent_dim]."""
    return _latent(weights, linear(weights["kv_a_proj_with_mqa"], x_BTD, policy), cos, sin, cfg)


def _latent(weights: Weights, kv, cos, sin, cfg: LingConfig) -> jax.Array:
    """`mla_latent` from kv, x's kv_a_proj_with_mqa product."""
    c = cfg
    c_kv = rms_norm(weights["kv_a_layernorm"], kv[..., : c.kv_lora_rank], c.rms_norm_eps)
    k_pe = apply_rope(kv[..., c.kv_lora_rank :], cos, sin, interleave=c.rope.interleave)
    return jnp.concatenate([c_kv, k_pe.astype(c_kv.dtype)], axis=-1)


def _kv_b_per_head(weights: Weights, cfg: LingConfig, dtype):
    """kv_b_proj's weight as [H, nope + v, R] in `dtype` (dequantised if quantised): each head's [W_UK ; W_UV]
    rows."""
    c = cfg
    return dequantized(weights["kv_b_proj"]["weight"], dtype).reshape(
        c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank
    )


def _kv_b_stored_per_head(weights: Weights, cfg: LingConfig, dtype):
    """`_kv_b_per_head` as stored where it can be: a quantised weight whose scale blocks do not straddle two heads
    stays quantised, its values and scales each split per head ([H, nope + v, R] and [H, rows / block, ...]), for
    the absorbed products to dequantise tile by tile (`pallas_kernels.mla.absorb_query`); otherwise dense."""
    c = cfg
    weight = weights["kv_b_proj"]["weight"]
    head_rows = c.qk_nope_head_dim + c.v_head_dim
    if not is_quantized(weight) or head_rows % weight.scale_block[0]:
        return _kv_b_per_head(weights, c, dtype)
    heads = c.num_attention_heads
    return dataclasses.replace(
        weight,
        values=weight.values.reshape(heads, head_rows, -1),
        scales=weight.scales.reshape(heads, head_rows // weight.scale_block[0], -1),
    )


def _per_head_product(op, kv_b_HCR, **kwargs):
    """x [M, H, *] -> op(x, kv_b, **kwargs) on each device's heads: x and every array of kv_b (dense or
    quantised) split by head."""
    parts, tree = jax.tree.flatten(kv_b_HCR)
    run = per_shard(
        lambda x_MHX, *parts: op(x_MHX, jax.tree.unflatten(tree, parts), **kwargs),
        (_BHD, *[_HCR] * len(parts)),
        (_BHD,),
    )
    return lambda x_MHX: run(x_MHX, *parts)


def mla_attend(
    weights: Weights,
    x_BTD,
    cos,
    sin,
    cfg: LingConfig,
    *,
    keys_BSA,
    visibility: KeyVisibility,
    decode_lengths_B,
    policy: ExecutionPolicy,
    page_table_BN=None,
    query_lengths_BT=None,
    q_first=None,
    project_output: bool = True,
) -> jax.Array:
    """Attend from the T tokens of x to the S latent entries keys_BSA (the cache, or the tokens themselves), in the
    policy's MLA mode (concrete: `ExecutionPolicy.for_call`) with its kernel backend.

    cos, sin: [B, T, rope_dim/2] for the queries. Expanded mode is the flash-style prefill path
    (`pallas_kernels.mla.mla_prefill`: memory O(block^2), not O(T x S)).
    decode_lengths_B: for a one-token decode over a cache whose first lengths[b] slots are visible,
    absorbed mode runs `pallas_kernels.mla.mla_decode` with it.
    page_table_BN: keys_BSA is then a paged cache's pages [P, page_size, A] (`ling_jax.cache`): a decode reads
    them in place (`mla_decode_paged`), every other call attends to each sequence's pages gathered in order.
    query_lengths_BT: for T tokens over a cache where token t sees exactly its first query_lengths[b, t] slots
    (the MTP verify pass), absorbed mode runs `pallas_kernels.mla.mla_decode_tokens` with it (one pass over the
    cache for the T tokens); None: the dense [B, T, S] mask of `visibility`.
    q_first: x's `_first_query_proj` product when the caller made it (`latent_attention`, with the latent's
    projection in one `linear_many`); None: projected here.
    project_output False: the output projection's input [B, T, H*V] in place of y, for the caller to project
    (`layers.linear_add_rms_norm`).
    """
    c = cfg
    mode, backend = policy.mla_mode, op_backend(policy)
    paged_decode = page_table_BN is not None and mode == ABSORBED and decode_lengths_B is not None
    if page_table_BN is not None and not paged_decode:
        keys_BSA = gather_pages(keys_BSA, page_table_BN)
    scale = softmax_scale(c)
    if q_first is None:
        q_first = linear(weights[_first_query_proj(c)], x_BTD, policy)
    q_nope, q_pe = _queries(weights, q_first, cos, sin, c, policy)
    if mode == ABSORBED:
        batch, length = x_BTD.shape[:2]
        kv_b_HCR = _kv_b_stored_per_head(weights, c, x_BTD.dtype)
        absorb = _per_head_product(absorb_query, kv_b_HCR, dtype=x_BTD.dtype, backend=backend)
        q_latent = absorb(q_nope.reshape(batch * length, *q_nope.shape[2:])).reshape(*q_nope.shape[:3], -1)
        if decode_lengths_B is None and query_lengths_BT is not None:
            decode = per_shard(
                functools.partial(mla_decode_tokens, scale=scale, backend=backend),
                in_axes=(_BTHD, _BTHD, _BSA, _BN),
                out_axes=(_BTHD,),
            )
            o_latent = decode(q_latent, q_pe, keys_BSA, query_lengths_BT)
        elif decode_lengths_B is None:
            o_latent = absorbed_attention(q_latent, q_pe, keys_BSA, visibility.dense(), scale=scale)
        elif paged_decode:
            decode = per_shard(
                functools.partial(mla_decode_paged, scale=scale, backend=backend),
                in_axes=(_BHD, _BHD, None, _BN, ("activation_batch",)),
                out_axes=(_BHD,),
            )
            o_latent = decode(q_latent[:, 0], q_pe[:, 0], keys_BSA, page_table_BN, decode_lengths_B)[:, None]
        else:
            decode = per_shard(
                functools.partial(mla_decode, scale=scale, backend=backend),
                in_axes=(_BHD, _BHD, _BSA, ("activation_batch",)),
                out_axes=(_BHD,),
            )
            o_latent = decode(q_latent[:, 0], q_pe[:, 0], keys_BSA, decode_lengths_B)[:, None]
        expand = _per_head_product(expand_output, kv_b_HCR, nope=c.qk_nope_head_dim, dtype=x_BTD.dtype, backend=backend)
        o_BTHV = expand(o_latent.reshape(batch * length, *o_latent.shape[2:]))
        o_BTHV = o_BTHV.reshape(batch, length, *o_BTHV.shape[1:]).astype(x_BTD.dtype)
    elif mode == EXPANDED:
        kv_b_HCR = _kv_b_per_head(weights, c, x_BTD.dtype)
        w_uk, w_uv = kv_b_HCR[:, : c.qk_nope_head_dim], kv_b_HCR[:, c.qk_nope_head_dim :]
        prefill = per_shard(
            functools.partial(mla_prefill, scale=scale, backend=backend, variant=policy.mla_prefill),
            in_axes=(_BTHD, _BTHD, _BSA, ("activation_batch", None), ("activation_batch", None), _HCR, _HCR),
            out_axes=(_BTHD,),
        )
        o_BTHV = prefill(q_nope, q_pe, keys_BSA, visibility.query_slots_BT, visibility.key_valid_BS, w_uk, w_uv)
    else:
        valid = ", ".join(repr(m.value) for m in MLAMode)
        raise ValueError(f"MLA mode must be one of {valid}, got {mode!r}")
    gate_BTH = jax.nn.sigmoid(linear(weights["g_proj"], x_BTD, policy).astype(jnp.float32))
    o_BTHV = o_BTHV * gate_BTH.astype(x_BTD.dtype)[..., None]
    o_BTC = o_BTHV.reshape(*x_BTD.shape[:2], -1)
    return linear(weights["dense"], o_BTC, policy) if project_output else o_BTC


def latent_attention(
    weights: Weights, x_BTD, cache: MLAState | None, ctx: TokenContext, cfg: LingConfig, *, project_output: bool = True
):
    """The MLA layer: x [B, T, D] (the input_layernorm output) -> (y [B, T, D], updated cache).

    weights: the layer's `attention` parameters. Without a cache (None) the tokens attend to themselves; with
    one (an MLAState, or a PagedMLAState through ctx.page_table_BN), their latents are written to slots
    ctx.slots_BT first (pads are dropped) and the tokens attend to the
    cache's visible slots (`ctx.visibility`), so a prefill then decodes over the returned cache equal one full
    call. Mode and kernel backend: `ctx.policy`. project_output: as in `mla_attend`.
    """
    q_first, kv = linear_many([weights[_first_query_proj(cfg)], weights["kv_a_proj_with_mqa"]], x_BTD, ctx.policy)
    latent_BTA = _latent(weights, kv, ctx.cos, ctx.sin, cfg)
    page_table_BN = None
    # over a cache (`token_context`: key_valid the first new_lengths[b] slots, query slots below it) query t sees
    # exactly its first query_slots[b, t] + 1 slots (a pad's -1: none)
    query_lengths_BT = None if cache is None else ctx.visibility.query_slots_BT + 1
    if cache is None:
        keys_BSA = latent_BTA
    elif isinstance(cache, PagedMLAState):
        num_pages, page_size = cache.latent_pages.shape[:2]
        page_table_BN = ctx.page_table_BN
        page_BT = jnp.take_along_axis(  # pads' slots lie past every table: no page, dropped
            page_table_BN, ctx.slots_BT // page_size, axis=1, mode="fill", fill_value=num_pages
        )
        keys_BSA = cache.latent_pages.at[page_BT, ctx.slots_BT % page_size].set(
            latent_BTA.astype(cache.latent_pages.dtype), mode="drop"
        )
        cache = PagedMLAState(latent_pages=keys_BSA)
    else:
        rows = jnp.arange(x_BTD.shape[0])[:, None]
        keys_BSA = cache.latent.at[rows, ctx.slots_BT].set(latent_BTA.astype(cache.latent.dtype), mode="drop")
        cache = MLAState(latent=keys_BSA)
    y = mla_attend(
        weights,
        x_BTD,
        ctx.cos,
        ctx.sin,
        cfg,
        keys_BSA=keys_BSA,
        visibility=ctx.visibility,
        decode_lengths_B=ctx.decode_lengths_B,
        policy=ctx.policy,
        page_table_BN=page_table_BN,
        query_lengths_BT=query_lengths_BT,
        q_first=q_first,
        project_output=project_output,
    )
    return y, cache


class MultiLatentAttention(nnx.Module):
    def __init__(self, config: LingConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        heads, hidden = c.num_attention_heads, c.hidden_size
        if c.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads * c.qk_head_dim, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        else:
            self.q_a_proj = Linear(hidden, c.q_lora_rank, axes=("q_lora", "embed"), dtype=dtype, rngs=rngs)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dtype=dtype)
            self.q_b_proj = Linear(
                c.q_lora_rank, heads * c.qk_head_dim, axes=("heads", "q_lora"), dtype=dtype, rngs=rngs
            )
        self.kv_a_proj_with_mqa = Linear(hidden, c.latent_dim, axes=("kv_latent", "embed"), dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps, dtype=dtype)
        self.kv_b_proj = Linear(
            c.kv_lora_rank,
            heads * (c.qk_nope_head_dim + c.v_head_dim),
            axes=("heads", "kv_latent"),
            dtype=dtype,
            rngs=rngs,
        )
        self.g_proj = Linear(hidden, heads, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        self.dense = Linear(heads * c.v_head_dim, hidden, axes=("embed", "heads"), dtype=dtype, rngs=rngs)

    def latent(self, x_BTD, cos, sin) -> jax.Array:
        """The per-token cache entry (`mla_latent`)."""
        return mla_latent(params_of(self), x_BTD, cos, sin, self.config)

    def __call__(
        self,
        x_BTD,
        cos,
        sin,
        *,
        keys_BSA,
        visibility: KeyVisibility,
        decode_lengths_B=None,
        policy: ExecutionPolicy | None = None,
    ) -> jax.Array:
        """`mla_attend` over keys_BSA (the cache, or the tokens themselves) with this layer's parameters, in the
        policy's mode with its kernel backend (None: `ExecutionPolicy()`). A policy without a mode: per call
        (`ExecutionPolicy.for_call`: absorbed for a one-token decode, given decode_lengths_B; expanded otherwise)."""
        return mla_attend(
            params_of(self),
            x_BTD,
            cos,
            sin,
            self.config,
            keys_BSA=keys_BSA,
            visibility=visibility,
            decode_lengths_B=decode_lengths_B,
            policy=as_policy(policy).for_call(x_BTD.shape[1], cached=decode_lengths_B is not None),
        )
