"""KDA chunked prefill on GPU: two phases of Pallas kernels (Triton lowering) over 64-token chunks, as in FLA.

1. `intra.intra_chunk` (three pallas_calls, each over independent programs): per chunk the
   decay-weighted q-k and k-k blocks, the inverse of (I + L), the WY factors w = T (e^G k), u = T v and the
   decayed q and k (no exponential can overflow fp32: for gates >= -5 in `chunk_kda_gpu`, for any gate in
   `chunk_kda_gpu_any_gate`, whose diagonal 16x16 blocks are formed from running products of per-step decays);
   another phase 1 with the same output may stand in (`phase1`: the lab's in `pallas_kernels.experimental`).
2. `inter.inter_chunk`, grid (V/block_v, B*H), one program walks the chunks in order, carrying its
   slice of the fp32 state and writing the output.
Both read and write the [B, T, H, ...] layout directly; T is padded to whole chunks (g = 0, beta = 0: an
identity update) only when it is not already a multiple of 64.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda import tuned
from pallas_kernels.kda.gpu_triton.inter import inter_chunk
from pallas_kernels.kda.gpu_triton.intra import CHUNK, intra_chunk, intra_chunk_any_gate


def _pad_time(x, pad: int):
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x


@functools.partial(
    jax.jit,
    static_argnames=("scale", "use_qk_l2norm", "parts_dtype", "tiles", "phase1", "identity_columns", "interpret"),
)
def chunk_kda_gpu(
    q,
    k,
    v,
    g,
    beta,
    initial_state=None,
    *,
    scale: float,
    use_qk_l2norm: bool = True,
    parts_dtype=None,
    tiles: tuned.ChunkTiles | None = None,
    phase1=intra_chunk,
    identity_columns: int = 0,
    interpret: bool = False,
):
    """(o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32) for log-decays g >= -5
    (`chunk_math.GATE_FLOOR`); with phase 1 `intra_chunk_any_gate` (`chunk_kda_gpu_any_gate`) for any g <= 0.

    The inputs are padded to whole chunks, phase 1 (`phase1`: `intra_chunk`'s signature, tiles.intra its tiles)
    gives their `ChunkParts`, phase 2 (`inter_chunk`, tiles.inter) carries the state. parts_dtype: how phase 1
    hands its per-chunk factors to phase 2 (default v's dtype; jnp.float32 with bf16 inputs keeps tf32 precision
    in phase 2 for twice the memory traffic). Tiles: None (or a phase's None) from that phase's table.
    identity_columns: the values as [0 | v], that many zero columns before v's (o [B, T, H, identity_columns + V],
    the state's last dimension identity_columns + V): how `segments` carries a segment's transition; phase 1
    forms only v's columns, phase 2 reads the zero ones as zeros (`inter_chunk`'s zero_columns).
    """
    batch, length, heads, key_dim = q.shape
    pad = -length % CHUNK
    q, k, v, g, beta = (
        _pad_time(x, pad) for x in (q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32)[..., None])
    )
    if initial_state is None:
        initial_state = jnp.zeros((batch, heads, key_dim, identity_columns + v.shape[-1]), jnp.float32)
    tiles = tiles or tuned.ChunkTiles()
    parts = phase1(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        parts_dtype=parts_dtype,
        tiles=tiles.intra,
        interpret=interpret,
    )
    o, state = inter_chunk(
        parts,
        initial_state.astype(jnp.float32),
        out_dtype=v.dtype,
        tiles=tiles.inter,
        zero_columns=identity_columns,
        interpret=interpret,
    )
    return o[:, :length], state


def chunk_kda_gpu_any_gate(q, k, v, g, beta, initial_state=None, **options):
    """`chunk_kda_gpu` for log-decays g <= 0 of any size (e.g. -A softplus(a) without the safe gate); options: its
    keywords, phase 1's tiles from `tuned.CHUNK_INTRA_ANY_GATE` when None."""
    return chunk_kda_gpu(q, k, v, g, beta, initial_state, phase1=intra_chunk_any_gate, **options)
