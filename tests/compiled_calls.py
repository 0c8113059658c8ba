"""Running a compiled test program (an AOTInductor runner of our CPU kernels' calls) with a given
number of OpenMP threads, which the kernels split their work over."""

from __future__ import annotations

from typing import List

import torch


def run_with_threads(runner: "torch._C._aoti.AOTIModelContainerRunnerCpu", args: List[torch.Tensor],
                     threads: int) -> List[torch.Tensor]:
    """``runner.run(args)`` with ``threads`` OpenMP threads; the caller's setting is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return runner.run(args)
    finally:
        torch.set_num_threads(before)
