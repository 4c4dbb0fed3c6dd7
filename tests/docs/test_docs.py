"""The docs are tested like the README: every python block of docs/**/*.md runs on the tiny preset unless marked
`<!-- not tested: REASON -->`, every fence names its language, and every relative link in README.md,
BENCHMARKS.md and docs/ resolves to a file, folder or heading. The README's python blocks run here too, after the
docs' (one module: the README's eager ops find many of those the docs' blocks compiled)."""

from __future__ import annotations

import pytest
from doc_blocks import ROOT, blocks, broken_links, heading_anchors, run_python_blocks

DOCS = sorted((ROOT / "docs").rglob("*.md"))
ALL_MARKDOWN = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *DOCS]
RUNNABLE = [p for p in DOCS if any(b.lang == "python" and b.skip_reason is None for b in blocks(p.read_text(), str(p)))]


def test_every_fence_names_its_language_and_every_marker_a_python_block():
    for path in ALL_MARKDOWN:
        blocks(path.read_text(), str(path))  # raises, naming the file and line


@pytest.mark.parametrize("path", RUNNABLE, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(path):
    run_python_blocks(path)


def test_readme_python_examples_run():
    readme = ROOT / "README.md"
    assert sum(b.lang == "python" and b.skip_reason is None for b in blocks(readme.read_text(), "README.md")) >= 1
    namespace = run_python_blocks(readme)
    assert namespace["cache"].lengths.tolist() == [6, 4]
    assert namespace["draft"].logits.shape[:2] == (2, 4)
    assert namespace["h_BTD"].shape == namespace["kda_y_BTD"].shape == namespace["x_BTD"].shape


def test_relative_links_resolve():
    broken = [f"{path.relative_to(ROOT)}: {link}" for path in ALL_MARKDOWN for link in broken_links(path)]
    assert not broken, "\n".join(broken)


def test_the_checks_can_fail(tmp_path):
    with pytest.raises(ValueError, match="page.md:3: a fence must name"):
        blocks("intro\n\n```\nprint(1)\n```\n", "page.md")
    with pytest.raises(ValueError, match="right before a python block"):
        blocks("<!-- not tested: needs a GPU -->\n```bash\nls\n```\n", "page.md")
    with pytest.raises(ValueError, match="not right before a python block"):
        blocks("<!-- not tested: needs a GPU -->\n\ntext\n\n```python\nx = 1\n```\n", "page.md")
    marked = blocks("<!-- not tested: needs a GPU -->\n```python\nimport gpu_only\n```\n", "page.md")
    assert marked[0].skip_reason == "needs a GPU" and marked[0].line == 3
    assert heading_anchors("# A `b.py` (c)\n## A `b.py` (c)\n```bash\n# not a heading\n```\n") == {
        "a-bpy-c",
        "a-bpy-c-1",
    }
    page = tmp_path / "page.md"
    page.write_text(
        "# Top\n[ok](#top) [here](page.md#top) [web](https://x.org/y) `[code](nowhere.md)`\n"
        "[gone](missing.md) [no heading](page.md#bottom)\n"
    )
    assert [b.split(" (")[0] for b in broken_links(page)] == ["missing.md", "page.md#bottom"]
