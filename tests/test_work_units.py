"""tests/conftest.py's work units for pytest-xdist: every file that DEMO_SERVER_FILES and LONGEST_UNITS name
exists, so that a renamed file cannot drop out of its unit or out of the order unnoticed."""

from __future__ import annotations

from helpers import REPO_ROOT

from tests.conftest import DEMO_SERVER_FILES, DEMO_SERVER_UNIT, LONGEST_UNITS


def test_the_named_files_exist():
    named = [*DEMO_SERVER_FILES, *(unit for unit in LONGEST_UNITS if unit != DEMO_SERVER_UNIT)]
    assert [path for path in named if not (REPO_ROOT / path).is_file()] == []
    assert len(set(LONGEST_UNITS)) == len(LONGEST_UNITS)
