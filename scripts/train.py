#!/usr/bin/env python3
"""Train a Ling model and export it: `python scripts/train.py --help`; the code is ling_jax/training/cli.py."""

from __future__ import annotations

import sys

from ling_jax.training.cli import script_main

if __name__ == "__main__":
    sys.exit(script_main())
