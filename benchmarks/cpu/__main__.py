"""python -m benchmarks.cpu: the CPU suite's main run (suite.py)."""

import sys

from benchmarks.cpu.suite import main

sys.exit(main())
