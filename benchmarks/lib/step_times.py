"""Reading per-step wall times: medians around a context and the time growth steps cost.

Pure functions (no torch, no runtime), shared by the CPU and CUDA suites.
"""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional


def median_ms(times: List[float], lo: int, window: int) -> Optional[float]:
    if len(times) < lo + window:
        return None
    return statistics.median(times[lo:lo + window]) * 1e3


def growth_share(times: List[float], grew: List[bool], half: int = 32) -> Dict[str, object]:
    """Time the growth steps took beyond a typical step nearby, as a share of all decode time."""
    extra = 0.0
    per = []
    for i, g in enumerate(grew):
        if not g:
            continue
        near = [times[j] for j in range(max(0, i - half), min(len(times), i + half + 1)) if not grew[j]]
        base = statistics.median(near) if near else 0.0
        per.append({"step": i, "ms": times[i] * 1e3, "extra_ms": max(0.0, times[i] - base) * 1e3})
        extra += max(0.0, times[i] - base)
    total = sum(times)
    return {"growth_steps": per, "growth_extra_ms": extra * 1e3,
            "growth_time_share": extra / total if total else None, "decode_total_ms": total * 1e3}
