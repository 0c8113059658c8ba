"""Export-time switches read from the environment, each with its allowed values.

A switch picks between lowerings kept side by side for comparison (the
benchmarks set them in the processes they export from); an unset or empty
variable means the default, anything else not allowed is an error naming the
variable and what it accepts.
"""

from __future__ import annotations

import os
from typing import Sequence


def switch(name: str, allowed: Sequence[str], default: str) -> str:
    """The value of environment switch ``name``: one of ``allowed``, ``default`` when unset or empty."""
    value = os.environ.get(name, "") or default
    if value not in allowed:
        others = ", ".join(repr(a) for a in allowed if a != default)
        raise ValueError(f"{name} must be {default!r} (the default) or {others}, got {value!r}")
    return value
