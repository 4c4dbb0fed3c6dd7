"""The figures live in one file, docs/benchmarks/figures.toml: BENCHMARKS.md's table of current figures and the
README's headline figures must equal what `benchmarks.figures` renders from it, every figure's notebook entry must
be a heading of its notebook, and the tuning tables' sources (the strings of pallas_kernels/*/tuned.py) cite
notebook entries by the same `docs/benchmarks/FILE.md#anchor` ids; every id there, comments included, resolves."""

from __future__ import annotations

import ast
import io
import re
import tokenize

import pytest
from doc_blocks import ROOT, heading_anchors

from benchmarks import figures

CITATION = re.compile(r"docs/benchmarks/(?P<file>\w+\.md)#(?P<anchor>[\w-]+)")
# a notebook or BENCHMARKS.md named without an entry id, as the tuning tables cited them before the ids
UNRESOLVABLE = re.compile(r"BENCHMARKS\.md, |docs/benchmarks/\w+\.md(?!#)")
TUNED = sorted(ROOT.glob("pallas_kernels/*/tuned.py"))


def strings_and_comments(path) -> tuple[str, str]:
    """A module's string constants (implicit concatenations joined, as Python joins them) and its comments."""
    text = path.read_text()
    strings = [n.value for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    comments = [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]
    return "\n".join(strings), "\n".join(comments)


def unresolved(citations: list[tuple[str, str]]) -> list[str]:
    anchors = {p.name: heading_anchors(p.read_text()) for p in (ROOT / "docs" / "benchmarks").glob("*.md")}
    return [f"{file}#{anchor}" for file, anchor in citations if anchor not in anchors.get(file, ())]


def test_rendered_sections_equal_the_data():
    stale = figures.stale_files(figures.load(), write=False)
    assert not stale, f"run python -m benchmarks.figures --write: {[str(p.relative_to(ROOT)) for p in stale]} differ"


def test_every_figure_links_an_existing_notebook_entry():
    entries = [CITATION.fullmatch(f.entry).group("file", "anchor") for f in figures.load()]
    assert not unresolved(entries)


@pytest.mark.parametrize("path", TUNED, ids=lambda p: str(p.relative_to(ROOT)))
def test_tuning_tables_cite_notebook_entries_that_exist(path):
    strings, comments = strings_and_comments(path)
    assert not UNRESOLVABLE.findall(strings), "cite docs/benchmarks/FILE.md#anchor"
    assert not unresolved(CITATION.findall(strings) + CITATION.findall(comments))


def test_the_checks_can_fail():
    assert unresolved([("kda.md", "no-such-heading"), ("nowhere.md", "top")]) == [
        "kda.md#no-such-heading",
        "nowhere.md#top",
    ]
    assert UNRESOLVABLE.findall("BENCHMARKS.md, 'KDA decode step' and docs/benchmarks/kda.md, 'x'")
    with pytest.raises(ValueError, match="expected one section"):
        figures.rendered("no markers here\n", "current", "| table |")
    one = figures.load()[0]
    with pytest.raises(ValueError, match="status"):
        figures.Figure(**{**vars(one), "status": "old"})
