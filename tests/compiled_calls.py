"""Running a compiled test program (an AOTInductor runner of our CPU kernels' calls) with a given
number of OpenMP threads, which the kernels split their work over, or with decode helper threads
(backend/native/shared_rows.h)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import List, Tuple

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


class StepHelpers:
    """The decode-helper face of a compiled program's kernels (decode_linear.cpp), through the runner's
    own library: dlopen of the same path gives the same instance, whose helper count is this thread's."""

    def __init__(self, library: Path) -> None:
        self.lib = ctypes.CDLL(str(library))
        self.lib.offgraph_kv_set_step_helpers.argtypes = [ctypes.c_int]
        self.lib.offgraph_kv_delay_step_helpers_for_tests.argtypes = [ctypes.c_int]

    def set(self, n: int) -> int:
        return self.lib.offgraph_kv_set_step_helpers(n)

    def delay(self, microseconds: int) -> None:
        self.lib.offgraph_kv_delay_step_helpers_for_tests(microseconds)

    def counts(self) -> Tuple[int, int]:
        """(chunks helpers published, chunks taken back from helpers) since the process began."""
        helped, taken = ctypes.c_int64(), ctypes.c_int64()
        self.lib.offgraph_kv_step_helper_counts(ctypes.byref(helped), ctypes.byref(taken))
        return helped.value, taken.value

    def quiesce(self) -> None:
        self.lib.offgraph_kv_quiesce_step_helpers()


def check_shared_with_helpers(runner: "torch._C._aoti.AOTIModelContainerRunnerCpu", library: Path,
                              cases: List[List[torch.Tensor]], stalled: bool, rounds: int = 8) -> None:
    """Every case run with one helper gives the bits it gives on one thread, ``rounds`` times over. With
    ``stalled`` each helper sleeps 3 ms after claiming a chunk (a preempted helper): the caller must take
    chunks back (counted) and every call still returns; else helpers must publish some chunks. (A case
    of many outputs keeps the caller busy long enough for a sleeping helper to wake and claim a chunk.)
    quiesce() then returns once the helpers have let go."""
    helpers = StepHelpers(library)
    before = helpers.set(0)
    try:
        want = [runner.run(args) for args in cases]
        helped0, taken0 = helpers.counts()
        helpers.delay(3000 if stalled else 0)
        helpers.set(1)
        for _ in range(rounds):
            for args, expected in zip(cases, want):
                for i, (g, w) in enumerate(zip(runner.run(args), expected)):
                    assert torch.equal(g, w), f"call {i} of a {tuple(w.shape)} case differs from one thread"
    finally:
        helpers.set(before)
        helpers.delay(0)
        helpers.quiesce()
    helped, taken = helpers.counts()
    if stalled:
        assert taken > taken0, "a stalled helper's chunks were never taken back"
    else:
        assert helped > helped0, "the helper published no chunk"
