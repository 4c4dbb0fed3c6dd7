"""What `scripts/generate.py` checks before it reads a single weight: the model directory with its config and
tokenizer, where the prompts come from and that they are UTF-8, the bounds of --mtp, and that the parameters and
the cache fit the device's memory on the mesh (`check_memory`).

Every refusal is a ValueError whose message names the file or flag and says what is wrong; the CLI prints it
as one `error: ...` line and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
from collections.abc import Mapping
from pathlib import Path

import jax

from ling_jax.build import load_model_config, text_config_of
from ling_jax.checkpoints.orbax import LAYOUT_FILE, StoredLayout
from ling_jax.checkpoints.safetensors_io import CheckpointTensors
from ling_jax.config import LingConfig
from ling_jax.generation.fit_check import check_fit
from ling_jax.generation.memory_plan import Hardware, device_hardware
from ling_jax.generation.tokenizer import Tokenizer, load_tokenizer
from ling_jax.presets import preset
from ling_jax.vl.config import LingVLConfig

# Drafts per speculative round. Ling has one MTP layer, trained to predict one token ahead; further drafts
# chain it on its own guesses, so their acceptance falls off geometrically, while every draft adds a step to
# the round (compiled unrolled: --mtp 100 took minutes to compile). SGLang runs Ling / DeepSeek MTP with 1-3.
MAX_MTP = 4
TOKENIZER_FILE = "tokenizer.json"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A model whose config and tokenizer are read and checked, its weights not loaded yet."""

    config: LingConfig | LingVLConfig
    tokenizer: Tokenizer
    name: str  # what is loaded, for messages
    path: Path | None = None  # None: a randomly initialised preset
    orbax: bool = False  # a ling-convert directory; else HF format

    @property
    def text_config(self) -> LingConfig:
        return text_config_of(self.config)

    @property
    def vl_config(self) -> LingVLConfig | None:
        return self.config if isinstance(self.config, LingVLConfig) else None


def preset_source(name: str) -> ModelSource:
    """A randomly initialised preset: text is tokenised as bytes (it has no tokenizer of its own)."""
    config = preset(name)
    return ModelSource(config, load_tokenizer(None, config), f"the random '{name}' preset")


def checkpoint_source(path: Path, what: str, *, byte_tokenizer: bool | None) -> ModelSource:
    """Check a HF or ling-convert checkpoint directory as far as it can be without reading weights: its
    layout file or safetensors index and shard headers, config.json, and the tokenizer. byte_tokenizer: the
    command's --byte-tokenizer flag; None for a command without one (a tokenizer.json is required)."""
    label = f"{what} {path}" if what.startswith("--") else f"{what} ({path})"
    if not path.is_dir():
        raise ValueError(f"{label}: not a directory (expected a HF checkpoint or ling-convert directory)")
    orbax = (path / LAYOUT_FILE).is_file()
    if orbax:
        StoredLayout.read(str(path))
    elif (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        CheckpointTensors(str(path))
    else:
        raise ValueError(
            f"{label}: expected a HF checkpoint directory (config.json and *.safetensors) or a "
            f"ling-convert directory ({LAYOUT_FILE}); found neither"
        )
    config = load_model_config(path)
    tokenizer = _checkpoint_tokenizer(path, text_config_of(config), byte_tokenizer)
    return ModelSource(config, tokenizer, str(path), path, orbax)


def _checkpoint_tokenizer(path: Path, config: LingConfig, byte_tokenizer: bool | None) -> Tokenizer:
    has_file = (path / TOKENIZER_FILE).is_file()
    if has_file and byte_tokenizer:
        raise ValueError(f"--byte-tokenizer: {path} has a {TOKENIZER_FILE}; drop the flag to use it")
    if not has_file and not byte_tokenizer:
        bytes_flag = (
            ""
            if byte_tokenizer is None
            else (", or pass --byte-tokenizer for a model trained on UTF-8 bytes (token id = byte value)")
        )
        raise ValueError(
            f"{path / TOKENIZER_FILE}: missing; a trained model's token ids are not bytes, so its "
            f"output would be noise. Put the checkpoint's {TOKENIZER_FILE} there{bytes_flag}"
        )
    return load_tokenizer(path, config)


def check_mtp(drafts: int) -> None:
    if drafts > MAX_MTP:
        raise ValueError(
            f"--mtp must be <= {MAX_MTP} (drafts per round chained through the one MTP layer; "
            f"later drafts are rarely accepted), got {drafts}"
        )


def device_memory() -> Hardware | None:
    """This process's first device's memory (its allocator's limit), or None where it reports none (a CPU)."""
    try:
        return device_hardware(jax.local_devices()[0])
    except ValueError:
        return None


def stores_quantized(source: ModelSource) -> bool:
    """Whether weights="stored" keeps weights quantised: a preset (as published, block FP8), a quantised HF
    checkpoint, or a ling-convert directory holding FP8 parameters."""
    if source.path is None:
        return True
    if source.orbax:
        return bool(StoredLayout.read(str(source.path)).scale_blocks)
    return source.text_config.quantization is not None


def check_memory(
    source: ModelSource,
    mesh_shape: Mapping[str, int],
    weights: str,
    dtype,
    *,
    batch: int,
    context: int,
    mtp: bool,
    devices: int,
) -> None:
    """Refuse, before any weight is read, a model whose parameters and decode cache cannot fit the device's memory
    on a mesh of `mesh_shape` (`ling_jax.generation.fit_check`): one line with the figures and a --weights or
    --mesh that would fit. Nothing is checked on a device that reports no memory limit (a CPU)."""
    hardware = device_memory()
    if hardware is None:
        return
    refusal = check_fit(
        source.config,
        mesh_shape,
        hardware,
        weights=weights,
        dtype=dtype,
        batch=batch,
        context=context,
        mtp=mtp,
        devices=devices,
        quantized=stores_quantized(source),
    )
    if refusal:
        raise ValueError(f"{source.name} {refusal}{memory_fraction_hint(jax.local_devices()[0].platform)}")


def memory_fraction_hint(platform: str) -> str:
    """The tail of a memory refusal on a GPU where jax keeps its default share of the memory (75%, preallocated):
    the variable that gives it more; empty elsewhere or once the variable is set."""
    if platform != "gpu" or "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ:
        return ""
    return "; jax takes 75% of a GPU's memory by default: XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 gives it more"


def stdin_is_input() -> bool:
    """Whether stdin may hold prompts: not a terminal, not closed, not a device such as /dev/null."""
    if sys.stdin is None or sys.stdin.isatty():
        return False
    mode = _stdin_mode()
    return mode is None or not stat.S_ISCHR(mode)


def read_stdin(what: str) -> str:
    """All of stdin as text (`what` names it in messages). Unless stdin is a file, a line on stderr first says
    that the prompts are awaited there: a pipe left open would otherwise wait without a word."""
    mode = _stdin_mode()
    if mode is not None and not stat.S_ISREG(mode):
        print(
            f"reading the prompts from {what}, one per line, until end of input (Ctrl-D on a terminal)",
            file=sys.stderr,
            flush=True,
        )
    buffer = getattr(sys.stdin, "buffer", None)
    return sys.stdin.read() if buffer is None else decode_utf8(buffer.read(), what)


def read_text_file(path: str, what: str) -> str:
    with open(path, "rb") as f:
        return decode_utf8(f.read(), what)


def decode_utf8(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from e


def _stdin_mode() -> int | None:
    """st_mode of stdin's file descriptor; None when it has none (replaced by a StringIO)."""
    try:
        return os.fstat(sys.stdin.fileno()).st_mode
    except (OSError, ValueError):
        return None
