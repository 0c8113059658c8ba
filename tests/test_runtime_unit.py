"""Runs the C++ unit tests of the store, growth, manifest reader and options (no model)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import offgraph_kv.runtime


def _unit_test_binary() -> Path:
    for root in offgraph_kv.runtime.__path__:
        candidate = Path(root) / "bin" / "offgraph_kv_unit_tests"
        if candidate.exists():
            return candidate
    raise AssertionError("offgraph_kv_unit_tests was not installed with the runtime")


def test_cpp_unit_tests_pass():
    result = subprocess.run([str(_unit_test_binary())], capture_output=True, text=True, timeout=120)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 failed checks" in result.stdout
    assert result.stdout.count("PASS ") >= 12
