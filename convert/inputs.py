"""SRC opened with one clear error per damaged file, before any tensor is read: config.json and
model.safetensors.index.json must be UTF-8 JSON objects (the index mapping tensor names to shard file names),
and a shard whose header does not parse is named."""

from __future__ import annotations

import json
import os

from convert import ConvertError
from ling_jax.build import load_model_config
from ling_jax.checkpoints.safetensors_io import INDEX_FILE, CheckpointTensors, SafetensorsFile
from ling_jax.config import LingConfig
from ling_jax.vl.config import LingVLConfig

CONFIG_FILE = "config.json"
# what a header that is JSON but not the safetensors layout makes the parser raise
_MALFORMED_HEADER = (KeyError, TypeError, AttributeError, IndexError)


def read_json_object(file: str) -> dict:
    with open(file, "rb") as f:
        data = f.read()
    try:
        body = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConvertError(f"{file}: not UTF-8 text (byte {e.start} is {data[e.start]:#04x})") from e
    except json.JSONDecodeError as e:
        raise ConvertError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(body, dict):
        raise ConvertError(f"{file}: expected a JSON object, found {type(body).__name__}")
    return body


def _shard_files(src: str) -> list[str]:
    """The shard file names the index lists (checked), or the directory's .safetensors files without one."""
    index = os.path.join(src, INDEX_FILE)
    if not os.path.isfile(index):
        return sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ConvertError(f"{index}: no 'weight_map' object (tensor name -> shard file name)")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file:
            raise ConvertError(f"{index}: 'weight_map' maps '{name}' to {file!r}, expected a shard file name")
    return sorted(set(weight_map.values()))


def _open_tensors(src: str, shards: list[str]) -> CheckpointTensors:
    try:
        return CheckpointTensors(src)
    except _MALFORMED_HEADER:
        for file in shards:
            path = os.path.join(src, file)
            try:
                SafetensorsFile(path)
            except _MALFORMED_HEADER as e:
                raise ConvertError(f"{path}: damaged safetensors header ({type(e).__name__}: {e})") from e
        raise


def open_source(src: str) -> tuple[LingConfig | LingVLConfig, CheckpointTensors]:
    """The config and tensors (every shard header parsed, nothing read) of the checkpoint directory `src`."""
    config_file = os.path.join(src, CONFIG_FILE)
    if os.path.isfile(config_file):
        read_json_object(config_file)
    shards = _shard_files(src)
    return load_model_config(src), _open_tensors(src, shards)
