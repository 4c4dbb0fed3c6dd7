"""The paged MLA decode TPU kernel (`tpu_mosaic.mla_decode_paged_tpu`: the pages read in place) in Pallas interpret
mode against float64 absorbed attention (`test_mla_decode.float64_attention`, written from the spec) and the jnp
reference over the gathered pages; the dispatcher's choice (in place or gathered); TPU lowering from the CPU at
ling-serve's size, without a gather of the pages."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_error
from test_mla_decode import LATENT, ROPE, TOL, float64_attention
from tpu_lowering import TPU_KINDS, lower_for_tpu

from ling_jax.serving.engine import PAGE_SIZE
from pallas_kernels.mla import mla_decode_paged, mla_decode_paged_reference
from pallas_kernels.mla.ops import kernel
from pallas_kernels.mla.tpu_mosaic import block_pages
from pallas_kernels.mla.tuned import DecodeTpuTiles

mla_decode_paged_tpu = kernel("mla_decode_paged", "tpu_mosaic")

MAX_PAGES = 4
SCALE = 1 / np.sqrt(192)


def paged_case(heads, page_size, dtype, seed):
    """Six sequences over a shuffled pool: lengths 1, page_size - 1 (sharing sequence 0's page), page_size + 1,
    3 pages + 2 and 4 pages (the two sharing their first two pages: a cached prefix), and 0; every table entry
    past a length garbage (-1, the pool size, a huge id, or a page of NaN), and every unseen row of a sequence's
    own last page NaN. Returns the (rounded) q_latent, q_rope and pool, the table, the lengths, and the float64
    spec output (zeros for the empty sequence)."""
    r = np.random.default_rng(seed)
    lengths = np.array([1, page_size - 1, page_size + 1, 3 * page_size + 2, 4 * page_size, 0], np.int32)
    batch, num_pages = len(lengths), len(lengths) * MAX_PAGES + 1
    rounded = lambda x: np.array(jnp.asarray(x, dtype).astype(jnp.float32))  # noqa: E731
    q_latent = rounded(r.normal(size=(batch, heads, LATENT)) * 0.2)
    q_rope = rounded(r.normal(size=(batch, heads, ROPE)))
    pool = rounded(r.normal(size=(num_pages, page_size, LATENT + ROPE)))
    ids = r.permutation(num_pages)
    nan_page, ids = ids[0], ids[1:]
    pool[nan_page] = np.nan
    table = ids.reshape(batch, MAX_PAGES).astype(np.int32)
    table[1, 0] = table[0, 0]
    table[4, :2] = table[3, :2]
    used = -(-lengths // page_size)
    garbage = np.array([-1, num_pages, 1 << 30, nan_page], np.int32)
    for b in range(batch):
        table[b, used[b] :] = garbage[(b + np.arange(MAX_PAGES - used[b])) % len(garbage)]
        if lengths[b] % page_size and b != 0:  # sequence 0's page is sequence 1's too: its row 1 is seen there
            pool[table[b, used[b] - 1], lengths[b] % page_size :] = np.nan
    contiguous = pool[np.clip(table, 0, num_pages - 1)].reshape(batch, MAX_PAGES * page_size, -1)
    spec = np.zeros(q_latent.shape)
    spec[:-1] = float64_attention(q_latent[:-1], q_rope[:-1], contiguous[:-1], lengths[:-1], SCALE)
    return (q_latent, q_rope, pool), table, lengths, spec


def check_paged_kernel(heads, page_size, dtype, tiles, seed=0):
    (q_latent, q_rope, pool), table, lengths, spec = paged_case(heads, page_size, dtype, seed)
    args = (*(jnp.asarray(x, dtype) for x in (q_latent, q_rope, pool)), jnp.asarray(table), jnp.asarray(lengths))
    out = mla_decode_paged_tpu(*args, scale=SCALE, tiles=tiles, interpret=True)
    assert out.shape == q_latent.shape and out.dtype == jnp.float32
    assert not np.asarray(out[-1]).any()  # no slot: zeros
    err = rel_error(out, spec)
    assert err <= TOL[dtype], f"H={heads} page {page_size} {tiles}: rel. error {err:.2e} against float64"
    finite = args[2].at[jnp.isnan(args[2])].set(0)  # the reference multiplies unseen rows by 0: NaN would stay
    ref = mla_decode_paged_reference(*args[:2], finite, *args[3:], scale=SCALE)
    assert rel_error(out, ref) <= TOL[dtype]


@pytest.mark.parametrize(
    "heads, page_size, dtype, tiles",
    [
        (4, 8, jnp.float32, DecodeTpuTiles(block_k=8, num_splits=3)),  # a page a block, 3 splits of 2 over 4 pages
        (5, 16, jnp.bfloat16, DecodeTpuTiles(block_k=48, num_splits=2)),  # 3 pages a block: 4 pages, a partial block
        (32, 16, jnp.bfloat16, DecodeTpuTiles(block_k=32, num_splits=1)),  # Ling-3.0-flash's heads, 2 pages a block
        (64, 8, jnp.float32, None),  # Ling-3.1-flash's heads, the table's tiles (every page in one block)
    ],
    ids=["fp32-1page", "bf16-3pages", "bf16-H32", "fp32-H64"],
)
def test_paged_kernel_matches_float64_attention(heads, page_size, dtype, tiles):
    check_paged_kernel(heads, page_size, dtype, tiles)


def test_pages_past_the_length_are_not_fetched():
    """Operand i of a block reads its own page while the sequence has one there, then keeps the page it read last
    (the same block index as the step before: no DMA); an operand with no page in the sequence stays on one
    page. Pages of 16 slots, 3 a block, 7 table columns (a partial last block) and a grid of 4 blocks; the table
    maps column n to page 10 + n, so that page ids are columns + 10."""
    lengths = np.array([0, 1, 15, 16, 17, 47, 48, 49, 100, 112])
    table = np.broadcast_to(10 + np.arange(7, dtype=np.int32), (len(lengths), 7))
    ids = block_pages(table, lengths, num_pages=17, page_size=16, pages_per_block=3, num_blocks=4)
    columns_BGI = np.asarray(ids).reshape(len(lengths), 4, 3) - 10
    for length, columns_GI in zip(lengths, columns_BGI):
        used = -(-length // 16)
        for block in range(4):
            for i in range(3):
                own = block * 3 + i
                expected = own if own < used else (columns_GI[block - 1, i] if block else i)
                assert columns_GI[block, i] == expected, (length, columns_GI)


def test_dispatcher_reads_tiled_pages_in_place_and_gathers_the_others():
    """interpret_tpu runs the paged kernel for pages of whole sublane tiles (no gather of pages in the program),
    and gathers pages it cannot tile (bf16 pages of 8 rows) for the contiguous kernel; both match float64. A named
    "tpu_mosaic" refuses such pages."""
    for page_size, gathered in ((16, False), (8, True)):
        (q_latent, q_rope, pool), table, lengths, spec = paged_case(4, page_size, jnp.bfloat16, seed=page_size)
        args = (*(jnp.asarray(x, jnp.bfloat16) for x in (q_latent, q_rope, pool)), table, lengths)
        run = functools.partial(mla_decode_paged, scale=SCALE, backend="interpret_tpu")
        jaxpr_lines = str(jax.make_jaxpr(run)(*args)).splitlines()
        assert any(" = gather[" in line and ":bf16[" in line for line in jaxpr_lines) == gathered
        assert rel_error(run(*args), spec) <= TOL[jnp.bfloat16]
    with pytest.raises(ValueError, match="multiple of 16 slots"):
        mla_decode_paged(*args, scale=SCALE, backend="interpret_tpu", variant="tpu_mosaic")


def abstract_paged(batch, heads, context, page_size, dtype):
    """ling-serve's decode operands: a pool of batch x context slots (+1: its empty page), a table of
    context / page_size pages a row."""
    pages = context // page_size
    return (
        jax.ShapeDtypeStruct((batch, heads, LATENT), dtype),
        jax.ShapeDtypeStruct((batch, heads, ROPE), dtype),
        jax.ShapeDtypeStruct((batch * pages + 1, page_size, LATENT + ROPE), dtype),
        jax.ShapeDtypeStruct((batch, pages), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )


@pytest.mark.parametrize("chip", sorted(TPU_KINDS))
def test_paged_kernel_lowers_for_tpu_without_a_gather(chip):
    """B=32 at 8,192 slots in ling-serve's pages (PAGE_SIZE), Ling's 64 heads, bf16: what "pallas_tpu" runs is the
    paged kernel on the pool as it is (no gather of its pages: only the table's few KB of page ids are gathered,
    `block_pages`); the gathered path gathers the pool."""
    args = abstract_paged(32, 64, 8192, PAGE_SIZE, jnp.bfloat16)
    on_tpu = functools.partial(mla_decode_paged, scale=0.07, backend="pallas_tpu")
    text = lower_for_tpu(on_tpu, *args, device_kind=TPU_KINDS[chip]).as_text()
    pool = f"tensor<{args[2].shape[0]}x{PAGE_SIZE}x576xbf16>"

    def gathers_pages(text):
        return any("stablehlo.gather" in line and pool in line for line in text.splitlines())

    assert "tpu_custom_call" in text and "mla_decode_split" in text and not gathers_pages(text)
    gathered = lower_for_tpu(functools.partial(on_tpu, variant="reference"), *args, device_kind=TPU_KINDS[chip])
    assert gathers_pages(gathered.as_text())
