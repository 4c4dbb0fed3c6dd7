import sys

from benchmarks.moe import main

sys.exit(main())
