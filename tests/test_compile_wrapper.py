"""The compiler wrapper every AOTInductor compile runs through."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from offgraph_kv.backend import aoti_compile


def test_compiler_wrapper_has_one_path_so_precompiled_headers_are_reused() -> None:
    # Inductor keys its precompiled headers on the compile command, compiler path included.
    first = aoti_compile.symbolic_compile_env()["CXX"]
    second = aoti_compile.symbolic_compile_env()["CXX"]
    assert first == second
    assert os.access(first, os.X_OK)


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf")
def test_compiler_wrapper_links_shared_objects_with_bsymbolic(tmp_path: Path) -> None:
    cxx = aoti_compile.symbolic_compile_env()["CXX"]
    src = tmp_path / "f.cpp"
    src.write_text("int f() { return 1; }\n")
    wrapped, plain = tmp_path / "wrapped.so", tmp_path / "plain.so"
    subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", str(wrapped)], check=True)
    subprocess.run([shutil.which("g++") or "g++", "-shared", "-fPIC", str(src), "-o", str(plain)], check=True)

    def dynamic_section(path: Path) -> str:
        return subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout

    assert "SYMBOLIC" in dynamic_section(wrapped)
    assert "SYMBOLIC" not in dynamic_section(plain)  # the flag is the wrapper's doing


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf")
def test_compiler_wrapper_emits_no_gnu_unique_symbols_so_dropped_code_can_be_unmapped(tmp_path: Path) -> None:
    cxx = aoti_compile.symbolic_compile_env()["CXX"]
    src = tmp_path / "u.cpp"
    # A static local of an inline function: g++ makes it STB_GNU_UNIQUE by default,
    # and one such symbol makes the whole library NODELETE.
    src.write_text("inline int& counter() { static int c = 0; return c; }\nint bump() { return ++counter(); }\n")
    wrapped, plain = tmp_path / "wrapped.so", tmp_path / "plain.so"
    subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", str(wrapped)], check=True)
    subprocess.run([shutil.which("g++") or "g++", "-shared", "-fPIC", str(src), "-o", str(plain)], check=True)

    def symbols(path: Path) -> str:
        return subprocess.run(["readelf", "-Ws", str(path)], capture_output=True, text=True).stdout

    assert "UNIQUE" in symbols(plain)
    assert "UNIQUE" not in symbols(wrapped)
