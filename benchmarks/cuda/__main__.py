"""python -m benchmarks.cuda: the CUDA suite's main run (suite.py)."""

import sys

from benchmarks.cuda.suite import main

sys.exit(main())
