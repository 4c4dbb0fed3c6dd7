"""The README's Python examples run as written, and its quick start is the CI command."""

from __future__ import annotations

import re

from doc_blocks import ROOT, blocks, run_python_blocks

README = (ROOT / "README.md").read_text()


def test_python_examples_run():
    assert sum(b.lang == "python" and b.skip_reason is None for b in blocks(README, "README.md")) >= 1
    namespace = run_python_blocks(ROOT / "README.md")
    assert namespace["cache"].lengths.tolist() == [6, 4]
    assert namespace["draft"].logits.shape[:2] == (2, 4)
    assert namespace["h_BTD"].shape == namespace["kda_y_BTD"].shape == namespace["x_BTD"].shape


def test_quick_start_is_two_commands_and_ci_runs_the_test_one():
    quick = re.search(r"## Quick start\n\n```bash\n(.*?)```", README, flags=re.DOTALL).group(1).strip().splitlines()
    assert len(quick) == 2 and "scripts/generate.py" in quick[0]
    assert '```bash\npip install -e ".[serve]" && ling-serve\n```' in README
    assert quick[1] in (ROOT / ".ci" / "run").read_text()


def test_quick_start_comes_first():
    headings = re.findall(r"^## (.+)$", README, flags=re.MULTILINE)
    assert headings[:2] == ["Quick start", "Status"]
