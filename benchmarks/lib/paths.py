"""Where the benchmarks find the repository, the example model and the results folder."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
LLAMA_DIR = REPO / "examples" / "llama"


def use_example_model() -> None:
    """Put ``examples/llama`` on ``sys.path``: every suite builds its model (``import model``)."""
    if str(LLAMA_DIR) not in sys.path:
        sys.path.insert(0, str(LLAMA_DIR))
