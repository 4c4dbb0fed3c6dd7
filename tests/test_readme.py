"""The README's Python examples run as written, and its quick start is the CI command."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    exec(compile("\n".join(blocks), "README.md", "exec"), namespace)
    assert namespace["cache"].lengths.tolist() == [6, 4]
    assert namespace["y"].shape == namespace["x"].shape


def test_quick_start_is_two_commands_and_ci_runs_the_test_one():
    quick = re.search(r"## Quick start\n\n```bash\n(.*?)```", README, flags=re.S).group(1).strip().splitlines()
    assert len(quick) == 2 and "scripts/generate.py" in quick[0]
    assert quick[1] in (ROOT / ".ci" / "run").read_text()
