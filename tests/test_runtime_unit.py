"""The C++ unit tests (store, growth, rewind, manifest reader, input checks,
code digest, options; no model), through ctest: in the build tree the install
made, and in a Debug build of their own with asserts on and AddressSanitizer +
UndefinedBehaviorSanitizer (any report fails the run)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _ctest() -> str:
    found = shutil.which("ctest") or str(Path(sys.executable).parent / "ctest")
    assert os.access(found, os.X_OK), "ctest not found (pip install cmake)"
    return found


def _run_ctest(build: Path, env: "dict | None" = None) -> str:
    done = subprocess.run([_ctest(), "--test-dir", str(build), "--output-on-failure"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "100% tests passed" in done.stdout
    return done.stdout


def test_cpp_unit_tests_pass_in_the_installed_build() -> None:
    builds = sorted(REPO.glob("build/*/CTestTestfile.cmake"), key=lambda p: p.stat().st_mtime)
    assert builds, "no build tree under build/: install with pip install --no-build-isolation -e ."
    out = _run_ctest(builds[-1].parent)
    assert int(out.split("tests passed out of ")[1].split()[0]) >= 23


SANITIZE = "-fsanitize=address,undefined"


def test_cpp_unit_tests_pass_in_a_debug_build_under_asan_and_ubsan(tmp_path: Path) -> None:
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.fail("cmake not found (pip install cmake)")
    build = tmp_path / "debug"
    configure = subprocess.run(
        [cmake, "-S", str(REPO / "runtime"), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Debug",
         "-DOFFGRAPH_KV_CUDA=OFF", f"-DPython_EXECUTABLE={sys.executable}",
         f"-DCMAKE_CXX_FLAGS={SANITIZE} -fno-sanitize-recover=undefined -fno-omit-frame-pointer",
         f"-DCMAKE_EXE_LINKER_FLAGS={SANITIZE}"],
        capture_output=True, text=True, timeout=300)
    assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
    compile_ = subprocess.run([cmake, "--build", str(build), "--target", "offgraph_kv_unit_tests"],
                              capture_output=True, text=True, timeout=900)
    assert compile_.returncode == 0, compile_.stdout[-4000:]
    # A sanitizer report aborts the test binary (leaks included), so ctest fails.
    _run_ctest(build, env=dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=1"))
