"""What DST may be, checked before any slow work and again just before publishing: apart from SRC (neither
holds the other, by real path), and new, empty, or an earlier ling-convert output for `--overwrite` to replace.

An earlier output is recognised by its `ling_convert.json` and by holding nothing but what a conversion
writes, so replacing one never deletes a file ling-convert did not write.
"""

from __future__ import annotations

import fnmatch
import json
import os

from convert import ConvertError
from convert.store import CHECKPOINT_METADATA_FILE, METADATA_FILE
from ling_jax.checkpoints.orbax import LAYOUT_FILE, LAYOUT_FORMAT

# Copied from SRC to DST beside the arrays (config.json, tokenizer and generation files).
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
    "chat_template*",
)
# Everything a finished conversion holds: orbax's OCDBT root and per-process databases, its metadata, ours.
OUTPUT_ENTRIES = (
    LAYOUT_FILE,
    METADATA_FILE,
    CHECKPOINT_METADATA_FILE,
    "manifest.ocdbt",
    "d",
    "ocdbt.process_*",
    *SIDE_FILES,
)
_SHOWN = 4


def _within(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory


def check_apart(src: str, dst: str, workspace: str, named_dst: str) -> None:
    """Refuse a DST that is SRC, holds it or lies inside it, and a SRC inside the workspace. `src`, `dst` and
    `workspace` are real paths (symlinks resolved); `named_dst` is DST as given, for the message."""
    shown = dst if named_dst == dst else f"{named_dst} (really {dst})"
    if src == dst:
        raise ConvertError(f"{shown}: the destination is the source checkpoint; choose another directory")
    if _within(src, dst):
        raise ConvertError(
            f"{shown}: the destination holds the source checkpoint {src}; choose a directory that does not contain it"
        )
    if _within(dst, src):
        raise ConvertError(
            f"{shown}: the destination lies inside the source checkpoint {src}; choose a directory outside it"
        )
    if _within(src, workspace):
        raise ConvertError(
            f"{src}: the source lies inside {workspace}, where the conversion to {dst} is built; "
            f"move it or choose another destination"
        )


def _listing(entries: list[str]) -> str:
    """'3 entries (a, b, c)', the first few names of long lists followed by '...'."""
    names = sorted(entries)
    shown = ", ".join(names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")
    return f"{len(names)} {'entry' if len(names) == 1 else 'entries'} ({shown})"


def _layout_problem(file: str) -> str | None:
    """Why `file` is not the layout file of a ling-convert output (None: it is one)."""
    if not os.path.isfile(file):
        return f"no {LAYOUT_FILE}"
    try:
        with open(file, "rb") as f:
            body = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as e:
        return f"{LAYOUT_FILE} unreadable: {e}"
    found = body.get("format") if isinstance(body, dict) else None
    if found != LAYOUT_FORMAT:
        return f"{LAYOUT_FILE} has format {found!r}, not {LAYOUT_FORMAT!r}"
    return None


def check_destination(dst: str, overwrite: bool) -> None:
    """Refuse a DST that exists and is not a directory, one that holds anything ling-convert did not write, and
    (without `overwrite`) an earlier output."""
    if os.path.lexists(dst) and not os.path.isdir(dst):
        raise ConvertError(f"{dst}: exists and is not a directory")
    entries = os.listdir(dst) if os.path.isdir(dst) else []
    if not entries:
        return
    problem = _layout_problem(os.path.join(dst, LAYOUT_FILE))
    if problem:
        raise ConvertError(
            f"{dst}: not an earlier ling-convert output ({problem}): replacing it would delete "
            f"{_listing(entries)}; --overwrite only replaces an earlier ling-convert output: choose a "
            f"new or empty directory"
        )
    foreign = [e for e in entries if not any(fnmatch.fnmatch(e, pattern) for pattern in OUTPUT_ENTRIES)]
    if foreign:
        raise ConvertError(
            f"{dst}: an earlier ling-convert output, but replacing it would also delete "
            f"{_listing(foreign)} that ling-convert did not write: move them out or choose a new or "
            f"empty directory"
        )
    if not overwrite:
        raise ConvertError(f"{dst}: already a finished checkpoint from ling-convert; pass --overwrite to replace it")
