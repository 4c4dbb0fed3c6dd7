import sys

from ling_jax.serving.cli import script_main

sys.exit(script_main())
