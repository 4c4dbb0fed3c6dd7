"""`ling-train`: the console script's parser answers --help and names the command."""

from __future__ import annotations

import pytest

from ling_jax.training.cli import main


def test_help_names_ling_train(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ling-train ")
