"""The README's quick start is the CI command and comes first (tests/docs/test_docs.py runs its Python examples)."""

from __future__ import annotations

import re

from doc_blocks import ROOT

README = (ROOT / "README.md").read_text()


def test_quick_start_is_two_commands_and_ci_runs_the_test_one():
    quick = re.search(r"## Quick start\n\n```bash\n(.*?)```", README, flags=re.DOTALL).group(1).strip().splitlines()
    assert len(quick) == 2 and "scripts/generate.py" in quick[0]
    assert '```bash\npip install -e ".[serve]" && ling-serve\n```' in README
    assert quick[1] in (ROOT / ".ci" / "run").read_text()


def test_ci_stops_on_a_lint_failure():
    """Each lint command on a line of its own: in an && list under `set -e` only the last command's failure ends
    the script, so `ruff check . && ruff format --check .` passed CI with ruff check failing."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "set -euo pipefail" in lines and "ruff check ." in lines and "ruff format --check ." in lines


def test_quick_start_comes_first():
    headings = re.findall(r"^## (.+)$", README, flags=re.MULTILINE)
    assert headings[:2] == ["Quick start", "Status"]
