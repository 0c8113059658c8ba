"""Our CPU kernels on every instruction set this machine can run, not only its best.

A program runs the ISA of the machine that exported it (``cpu_kernels._compile_flags``
takes inductor's), so each path of ``backend/native`` (AVX-512 with and without VNNI,
AVX2, scalar) ships on some machine; CI sees one. Here the kernels' own test files run
again in a child process with ``ATEN_CPU_CAPABILITY`` set below the machine's best
(inductor's ISA then follows it, and so do the kernels' flags): AVX2 and scalar on an
AVX-512 machine. AVX-512 without VNNI is reached only on such a machine
(``ATEN_CPU_CAPABILITY=avx512`` picks inductor's best AVX-512 ISA, VNNI included). The int8-weight dynamic
kernel once saturated its dots on AVX2 only (``maddubs`` over ``xq + 128``), which the
AVX-512 VNNI machine's run could not see.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

KERNEL_TESTS = ("test_cpu_linear_kernel.py", "test_dynamic_linear_kernels.py", "test_cpu_attention_kernel.py")
# ATEN_CPU_CAPABILITY's values, best first; "default" is inductor's scalar code (no -m flags).
CAPABILITIES = ("avx512", "avx2", "default")


def _best_capability() -> str:
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = str(pick_vec_isa())
    return next((c for c in CAPABILITIES[:-1] if c in isa.split()), "default")


def _below_best() -> List[str]:
    if os.environ.get("ATEN_CPU_CAPABILITY"):  # already the child run
        return []
    return list(CAPABILITIES[CAPABILITIES.index(_best_capability()) + 1:])


@pytest.mark.parametrize("capability", _below_best() or [pytest.param("none", marks=pytest.mark.skip(
    reason="no instruction set below this machine's best, or already a child run"))])
def test_cpu_kernels_match_their_references_on_each_lower_instruction_set(capability: str, tmp_path: Path) -> None:
    here = Path(__file__).parent
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    flags = subprocess.run([sys.executable, "-c", "from offgraph_kv.backend.cpu_kernels import _compile_flags; "
                            "print(' '.join(_compile_flags()))"], env=env, capture_output=True, text=True, check=True)
    wanted = {"avx512": "-mavx512f", "avx2": "-mavx2"}.get(capability)
    assert (wanted in flags.stdout.split()) if wanted else "-mavx" not in flags.stdout, flags.stdout
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           "--basetemp", str(tmp_path / "t"), *(str(here / t) for t in KERNEL_TESTS)],
                          cwd=here.parent, env=env, capture_output=True, text=True)
    tail = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, f"kernel tests with ATEN_CPU_CAPABILITY={capability}:\n{tail}"
    assert " passed" in tail and " failed" not in tail, tail
