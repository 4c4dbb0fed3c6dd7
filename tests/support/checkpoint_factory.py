"""Writes HF-format Ling test checkpoints exactly as spec §6 describes (sharded safetensors, block FP8, MXFP4).

Pure numpy + ml_dtypes (the safetensors format is implemented by hand so that BF16 / F8_E4M3 / F8_E8M0 work
without torch). Main entry points:

* ``quantize_fp8_block`` / ``dequantize_fp8_block``   - 128x128 block FP8 (scale MULTIPLIES; name ``weight_scale_inv``)
* ``quantize_mxfp4``                                  - packed E2M1 + E8M0 per-32 scales (unpacked and dequantised
                                                        by ``ling_jax.quant``, as the loaders do)
* ``write_safetensors`` / ``read_safetensors``        - one .safetensors file <-> dict of numpy arrays (native dtypes)
* ``read_checkpoint_tensors``                         - (config, name -> float32) from a save_pretrained dir
* ``write_hf_checkpoint``                             - config.json + N shards + model.safetensors.index.json
* ``make_quantized_checkpoint``                       - oracle checkpoint -> real-Ling-style FP8 (+MXFP4) checkpoint,
                                                        returning what a correct loader must produce (float32)
"""

from __future__ import annotations

import json
import pathlib
import re
import struct

import ml_dtypes
import numpy as np

from ling_jax.quant import E2M1_VALUES, MXFP4_GROUP, dequantize_mxfp4

FP8_MAX = 448.0  # float8_e4m3fn max finite

# ---------------------------------------------------------------------------------------------------------------
# safetensors (hand-written)
# ---------------------------------------------------------------------------------------------------------------

_NP_TO_ST = [
    (np.dtype(np.float64), "F64"),
    (np.dtype(np.float32), "F32"),
    (np.dtype(np.float16), "F16"),
    (np.dtype(ml_dtypes.bfloat16), "BF16"),
    (np.dtype(ml_dtypes.float8_e4m3fn), "F8_E4M3"),
    (np.dtype(ml_dtypes.float8_e5m2), "F8_E5M2"),
    (np.dtype(ml_dtypes.float8_e8m0fnu), "F8_E8M0"),
    (np.dtype(np.int64), "I64"),
    (np.dtype(np.int32), "I32"),
    (np.dtype(np.int16), "I16"),
    (np.dtype(np.int8), "I8"),
    (np.dtype(np.uint8), "U8"),
    (np.dtype(np.bool_), "BOOL"),
]
_ST_TO_NP = {s: d for d, s in _NP_TO_ST}


def _st_dtype(arr: np.ndarray) -> str:
    for d, s in _NP_TO_ST:
        if arr.dtype == d:
            return s
    raise TypeError(f"write_safetensors: unsupported dtype {arr.dtype}")


def write_safetensors(path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """8-byte LE header length + JSON header (dtype/shape/data_offsets, padded with spaces to 8 bytes) + raw bytes."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    blobs = []
    offset = 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(np.asarray(arr))
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        raw = arr.tobytes(order="C")
        header[name] = {
            "dtype": _st_dtype(arr),
            "shape": [int(s) for s in arr.shape],
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * ((-len(hbytes)) % 8)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for b in blobs:
            f.write(b)


def read_safetensors(path) -> dict[str, np.ndarray]:
    """name -> numpy array in the stored dtype (ml_dtypes for BF16 / F8_*)."""
    data = pathlib.Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n].decode("utf-8"))
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        s, e = info["data_offsets"]
        dt = _ST_TO_NP[info["dtype"]]
        out[name] = np.frombuffer(data[base + s : base + e], dtype=dt).reshape(info["shape"]).copy()
    return out


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def read_checkpoint_raw(src_dir) -> tuple[dict, dict[str, np.ndarray]]:
    """(config dict, name -> array in its STORED dtype) from a HF dir (single file or sharded index)."""
    src = pathlib.Path(src_dir)
    config = json.loads((src / "config.json").read_text())
    idx = src / "model.safetensors.index.json"
    if idx.exists():
        files = sorted(set(json.loads(idx.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in src.glob("*.safetensors"))
    tensors: dict[str, np.ndarray] = {}
    for fn in files:
        tensors.update(read_safetensors(src / fn))
    return config, tensors


def read_checkpoint_tensors(src_dir) -> tuple[dict, dict[str, np.ndarray]]:
    """(config dict, name -> float32 numpy) from a save_pretrained dir. Integer tensors are returned unchanged."""
    config, raw = read_checkpoint_raw(src_dir)
    out = {}
    for k, v in raw.items():
        out[k] = v if np.issubdtype(v.dtype, np.integer) or v.dtype == np.bool_ else v.astype(np.float32)
    return config, out


def write_hf_checkpoint(dst_dir, config: dict, tensors: dict[str, np.ndarray], num_shards: int = 3) -> None:
    """config.json + model-0000i-of-0000N.safetensors + model.safetensors.index.json.

    Tensors are laid out in natural name order and cut into byte-balanced contiguous shards, so a layer's tensors
    (and a weight and its ``weight_scale_inv``) may straddle shard boundaries."""
    dst = pathlib.Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    for stale in list(dst.glob("model*.safetensors")) + [dst / "model.safetensors.index.json"]:
        if stale.exists():
            stale.unlink()
    names = sorted(tensors, key=_natural_key)
    num_shards = max(1, min(int(num_shards), len(names)))
    sizes = [np.asarray(tensors[n]).nbytes for n in names]
    total = int(sum(sizes))
    # contiguous split: shard i gets the names whose cumulative-byte midpoint falls in [i/N, (i+1)/N) of the total
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    cum = 0
    for n, sz in zip(names, sizes):
        mid = cum + sz / 2.0
        shards[min(num_shards - 1, int(mid * num_shards / max(total, 1)))].append(n)
        cum += sz
    # make sure no shard is empty (tiny inputs): steal from neighbours while keeping order
    flat = [n for s in shards for n in s]
    if any(not s for s in shards):
        per = [len(flat) // num_shards + (1 if i < len(flat) % num_shards else 0) for i in range(num_shards)]
        shards, i0 = [], 0
        for c in per:
            shards.append(flat[i0 : i0 + c])
            i0 += c
    weight_map = {}
    for i, shard in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        write_safetensors(dst / fn, {n: tensors[n] for n in shard})
        for n in shard:
            weight_map[n] = fn
    index = {"metadata": {"total_size": total}, "weight_map": {n: weight_map[n] for n in names}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# Block FP8
# ---------------------------------------------------------------------------------------------------------------


def quantize_fp8_block(w: np.ndarray, block=(128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """-> (float8_e4m3fn [O, In], float32 scale [ceil(O/bo), ceil(In/bi)]); W ~= fp8 * scale (scale multiplies).

    scale = blockwise amax / 448 (1.0 for an all-zero block); edge blocks may be partial."""
    w = np.asarray(w, dtype=np.float32)
    assert w.ndim == 2, w.shape
    O, In = w.shape
    bo, bi = int(block[0]), int(block[1])
    no, ni = -(-O // bo), -(-In // bi)
    pad = np.zeros((no * bo, ni * bi), np.float32)
    pad[:O, :In] = w
    blocks = pad.reshape(no, bo, ni, bi)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    q = blocks / scale[:, None, :, None]
    q = np.clip(q, -FP8_MAX, FP8_MAX).reshape(no * bo, ni * bi)[:O, :In]
    return q.astype(ml_dtypes.float8_e4m3fn), scale


def expand_block_scale(scale: np.ndarray, shape, block=(128, 128)) -> np.ndarray:
    O, In = shape
    return np.repeat(np.repeat(np.asarray(scale, np.float32), block[0], 0), block[1], 1)[:O, :In]


def dequantize_fp8_block(q: np.ndarray, scale: np.ndarray, block=(128, 128)) -> np.ndarray:
    """W[r, c] = fp8[r, c] * scale[r // bo, c // bi] (float32; exact, fp8 has 4 significant bits)."""
    return q.astype(np.float32) * expand_block_scale(scale, q.shape, block)


# ---------------------------------------------------------------------------------------------------------------
# MXFP4
# ---------------------------------------------------------------------------------------------------------------


def _round_to_e2m1_codes(v: np.ndarray) -> np.ndarray:
    """Nearest E2M1 code (ties -> even code, i.e. even mantissa), saturating at +-6; sign bit only if nonzero."""
    mags = E2M1_VALUES[:8]
    a = np.minimum(np.abs(v), 6.0)[..., None]
    d = np.abs(a - mags)
    dmin = d.min(axis=-1, keepdims=True)
    cand = d == dmin
    even = cand & (np.arange(8) % 2 == 0)
    code = np.where(even.any(-1), even.argmax(-1), cand.argmax(-1)).astype(np.uint8)
    sign = ((v < 0) & (code != 0)).astype(np.uint8)
    return code | (sign << 3)


def quantize_mxfp4(
    w: np.ndarray, scale_format: str = "float32", group: int = MXFP4_GROUP
) -> tuple[np.ndarray, np.ndarray]:
    """-> (uint8 packed [O, In/2], scales [O, ceil(In/32)]).

    Byte j of a row holds element 2j in the LOW nibble and element 2j+1 in the HIGH nibble; nibble codes 0..7 =
    0, .5, 1, 1.5, 2, 3, 4, 6 and 8..15 the negated values. Scale per 32 consecutive inputs is a power of two
    2^e with the smallest e such that amax / 2^e <= 6 (no clipping), 1.0 for all-zero groups; E8M0 u = e + 127.
    Elements are rounded to the nearest representable value. If In % 32 != 0 the last group is partial.
    scale_format: "float32" (fp32 2^e), "e8m0" (ml_dtypes.float8_e8m0fnu), "uint8" (raw exponent u)."""
    w = np.asarray(w, dtype=np.float32)
    assert w.ndim == 2, w.shape
    O, In = w.shape
    if In % 2:
        raise ValueError(f"MXFP4 needs an even input dim, got {In}")
    ng = -(-In // group)
    pad = np.zeros((O, ng * group), np.float32)
    pad[:, :In] = w
    g = pad.reshape(O, ng, group)
    amax = np.abs(g).max(-1).astype(np.float64)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.ceil(np.log2(np.where(amax > 0, amax, 1.0) / 6.0)), 0.0)
    # guard log2 rounding: make sure amax / 2^e <= 6 and amax / 2^(e-1) > 6
    e = np.where((amax > 0) & (amax / np.exp2(e) > 6.0), e + 1, e)
    e = np.where((amax > 0) & (amax / np.exp2(e - 1) <= 6.0), e - 1, e)
    e = np.clip(e, -127, 127).astype(np.int32)
    scale = np.exp2(e.astype(np.float64)).astype(np.float32)  # 2^-127 is an fp32 subnormal: still exact
    codes = _round_to_e2m1_codes(g / scale[..., None]).reshape(O, ng * group)[:, :In]
    packed = (codes[:, 0::2] & 0xF) | ((codes[:, 1::2] & 0xF) << 4)
    packed = packed.astype(np.uint8)
    u = (e + 127).astype(np.uint8)
    if scale_format == "float32":
        s = scale
    elif scale_format == "e8m0":
        s = u.view(ml_dtypes.float8_e8m0fnu).copy()
    elif scale_format == "uint8":
        s = u
    else:
        raise ValueError(f"unknown scale_format {scale_format!r}")
    return packed, s


# ---------------------------------------------------------------------------------------------------------------
# Quantized Ling checkpoints
# ---------------------------------------------------------------------------------------------------------------

_ROUTED_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts\.\d+\.(?:gate|up|down)_proj)\.weight$")
_FP8_MODULE_RES = [
    # KDA (full rank and low-rank variants) and MLA projections; KDA g_proj handled separately (MLA g_proj is not)
    re.compile(
        r"\.attention\.(?:q_proj|k_proj|v_proj|f_proj|dense|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj"
        r"|f_a_proj|f_b_proj|g_a_proj|g_b_proj)$"
    ),
    re.compile(r"\.mlp\.(?:gate_proj|up_proj|down_proj)$"),  # dense MLP
    re.compile(r"\.mlp\.experts\.\d+\.(?:gate|up|down)_proj$"),  # routed experts
    re.compile(r"\.mlp\.shared_experts\.(?:gate|up|down)_proj$"),  # shared experts
    re.compile(r"\.eh_proj$"),  # MTP
]
_FP32_KEEP_RE = re.compile(r"(\.A_log|\.dt_bias|conv1d\.weight|\.expert_bias)$")
_DENSE_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}


def _layer_prefix(name: str) -> str | None:
    m = re.match(r"^(model\.layers\.\d+)\.", name)
    return m.group(1) if m else None


def _is_kda_layer(prefix: str | None, tensors: dict) -> bool:
    return prefix is not None and f"{prefix}.attention.A_log" in tensors


def classify_tensor(name: str, tensors: dict, mxfp4_experts: bool = False) -> str:
    """'mxfp4' | 'fp8' | 'fp32' | 'dense' (= kept in dense_dtype) for a tensor of an original-name checkpoint."""
    arr = tensors[name]
    if _FP32_KEEP_RE.search(name):
        return "fp32"
    if not name.endswith(".weight") or np.ndim(arr) != 2:
        return "dense"
    module = name[: -len(".weight")]
    if mxfp4_experts and _ROUTED_EXPERT_RE.match(name):
        return "mxfp4"
    if re.search(r"\.attention\.g_proj$", module):
        return "fp8" if _is_kda_layer(_layer_prefix(name), tensors) else "dense"  # MLA head-wise gate stays dense
    if any(r.search(module) for r in _FP8_MODULE_RES):
        return "fp8"
    return "dense"  # embeddings, lm_head, norms, router gate, KDA b_proj, ...


def make_quantized_checkpoint(
    src_dir,
    dst_dir,
    *,
    mxfp4_experts: bool = False,
    block=(128, 128),
    num_shards: int = 3,
    mxfp4_scale_format: str = "float32",
    dense_dtype: str = "bfloat16",
    mxfp4_packed_dtype: str = "uint8",
) -> dict[str, np.ndarray]:
    """Oracle save_pretrained dir -> block-FP8 (optionally MXFP4 routed experts) checkpoint like real Ling ones.

    Returns name -> float32 DEQUANTIZED value for every weight written under its original name (the
    ``weight_scale_inv`` companions are not included): exactly what a correct loader must produce."""
    block = (int(block[0]), int(block[1]))
    config, tensors = read_checkpoint_tensors(src_dir)
    ddt = _DENSE_DTYPES[dense_dtype]
    out: dict[str, np.ndarray] = {}
    deq: dict[str, np.ndarray] = {}
    not_convert: list[str] = []
    for name in sorted(tensors, key=_natural_key):
        w = np.asarray(tensors[name], np.float32)
        kind = classify_tensor(name, tensors, mxfp4_experts)
        if kind == "fp8":
            q, s = quantize_fp8_block(w, block)
            out[name] = q
            out[name[: -len("weight")] + "weight_scale_inv"] = s
            deq[name] = dequantize_fp8_block(q, s, block)
        elif kind == "mxfp4":
            packed, s = quantize_mxfp4(w, mxfp4_scale_format)
            if mxfp4_packed_dtype == "int8":
                packed = packed.view(np.int8)
            elif mxfp4_packed_dtype != "uint8":
                raise ValueError(mxfp4_packed_dtype)
            out[name] = packed
            out[name[: -len("weight")] + "weight_scale_inv"] = s
            deq[name] = dequantize_mxfp4(packed, s)
            assert deq[name].shape == w.shape
        elif kind == "fp32":
            out[name] = w
            deq[name] = w.copy()
        else:
            stored = w.astype(ddt)
            out[name] = stored
            deq[name] = stored.astype(np.float32)
            if name.endswith(".weight") and w.ndim == 2:
                not_convert.append(name[: -len(".weight")])
    qc = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": not_convert,
    }
    if mxfp4_experts:
        qc["routed_experts_quant_method"] = "mxfp4"
    config = dict(config)
    config["quantization_config"] = qc
    config["dtype"] = dense_dtype
    write_hf_checkpoint(dst_dir, config, out, num_shards=num_shards)
    return deq
