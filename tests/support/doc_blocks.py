"""The fenced code blocks, headings and relative links of the markdown docs, for tests/docs/test_readme.py and
tests/docs/test_docs.py.

A python block runs unless the line before its fence is `<!-- not tested: REASON -->`; every fence names its
language (one of LANGUAGES), so no python block can hide from the runner as an untagged one.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
LANGUAGES = ("python", "bash", "text")
_FENCE = re.compile(r"^```(?P<lang>[^\n`]*)\n(?P<code>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_MARKER = re.compile(r"<!--\s*not tested:(?P<reason>[^>]*)-->")
_MARKER_BEFORE_FENCE = re.compile(r"<!--\s*not tested:(?P<reason>[^>]*)-->[ \t]*\n\Z")
_LINK = re.compile(r"!?\[[^\]\n]*\]\((?P<target>[^)\s]+)\)")
_INLINE_CODE = re.compile(r"`[^`\n]*`")


@dataclasses.dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # line of the block's first code line in its file (1-based)
    skip_reason: str | None  # why a python block is not run, from its marker; None: it runs


def blocks(text: str, name: str) -> list[Block]:
    """The fenced blocks of a markdown text, in order. ValueError (naming `name` and the line) for a fence without
    a known language, a marker with no reason, or a marker that is not right before a python block."""
    found, markers_used, start = [], 0, 0
    for fence in _FENCE.finditer(text):
        line = text.count("\n", 0, fence.start()) + 2
        lang = fence["lang"].strip()
        if lang not in LANGUAGES:
            raise ValueError(f"{name}:{line - 1}: a fence must name one of {LANGUAGES}, got {lang!r}")
        marker = _MARKER_BEFORE_FENCE.search(text, start, fence.start())
        reason = None
        if marker:
            reason = marker["reason"].strip()
            if lang != "python" or not reason:
                raise ValueError(
                    f"{name}:{line - 1}: '<!-- not tested: REASON -->' needs a reason and must come "
                    f"right before a python block"
                )
            markers_used += 1
        found.append(Block(lang, fence["code"], line, reason))
        start = fence.end()
    if len(_MARKER.findall(_prose(text))) != markers_used:
        raise ValueError(f"{name}: a '<!-- not tested: ... -->' marker is not right before a python block")
    return found


def run_python_blocks(path: pathlib.Path) -> dict:
    """Runs the unmarked python blocks of one file in order, in one namespace (tracebacks name the file and its
    lines); returns the namespace."""
    namespace: dict = {"__name__": f"doc_{path.stem}"}
    for block in blocks(path.read_text(), str(path)):
        if block.lang == "python" and block.skip_reason is None:
            exec(compile("\n" * (block.line - 1) + block.code, str(path), "exec"), namespace)
    return namespace


def _prose(text: str) -> str:
    """The text without its fenced blocks and inline code (where '#' and '[..](..)' are not markdown)."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a markdown text's headings: lowercased, punctuation dropped, spaces to hyphens, a
    repeated anchor suffixed -1, -2, ..."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", _FENCE.sub("", text), flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def broken_links(path: pathlib.Path) -> list[str]:
    """The relative links and images of one markdown file whose target file, folder or heading does not exist,
    each as 'target (what is missing)'."""
    broken = []
    for target in _LINK.findall(_prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target} (no {file_part})")
        elif anchor and (resolved.suffix != ".md" or anchor not in heading_anchors(resolved.read_text())):
            broken.append(f"{target} (no heading #{anchor} in {file_part or path.name})")
    return broken
