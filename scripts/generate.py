"""Generate text with a Ling 3.x model: `python scripts/generate.py --help`; the code is ling_jax/generation/cli.py."""

from __future__ import annotations

import sys

from ling_jax.generation.cli import script_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(script_main())
