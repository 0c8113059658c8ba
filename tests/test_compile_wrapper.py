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


def _wrapped_and_plain(tmp_path: Path, source: str, readelf_flag: str) -> "tuple[str, str]":
    """readelf's view of `source` built as a shared object by the wrapper and by plain g++."""
    src = tmp_path / "lib.cpp"
    src.write_text(source)
    out = []
    for cxx, name in ((aoti_compile.symbolic_compile_env()["CXX"], "wrapped"), (shutil.which("g++") or "g++", "plain")):
        lib = tmp_path / f"{name}.so"
        subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
        out.append(subprocess.run(["readelf", readelf_flag, str(lib)], capture_output=True, text=True).stdout)
    return out[0], out[1]


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf")
def test_compiler_wrapper_links_shared_objects_with_bsymbolic(tmp_path: Path) -> None:
    wrapped, plain = _wrapped_and_plain(tmp_path, "int f() { return 1; }\n", "-d")
    assert "SYMBOLIC" in wrapped
    assert "SYMBOLIC" not in plain  # the flag is the wrapper's doing


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf")
def test_compiler_wrapper_emits_no_gnu_unique_symbols_so_programs_do_not_share_statics(tmp_path: Path) -> None:
    # A static local of an inline function: g++ makes it STB_GNU_UNIQUE by default,
    # which the dynamic linker binds process-wide, across libraries.
    wrapped, plain = _wrapped_and_plain(
        tmp_path, "inline int& counter() { static int c = 0; return c; }\nint bump() { return ++counter(); }\n", "-Ws")
    assert "UNIQUE" in plain
    assert "UNIQUE" not in wrapped


def test_compiler_wrapper_links_an_object_listed_twice_once(tmp_path: Path) -> None:
    # AOTInductor can name one embedded kernel's cubin object twice in a link;
    # plain g++ then fails with multiple definitions, the wrapper links it once.
    obj = tmp_path / "kernel.o"
    (tmp_path / "kernel.cpp").write_text("extern \"C\" int kernel_start = 1;\nint f() { return kernel_start; }\n")
    subprocess.run(["g++", "-c", "-fPIC", str(tmp_path / "kernel.cpp"), "-o", str(obj)], check=True)
    cmd = ["-shared", "-fPIC", str(obj), str(obj), "-o"]
    plain = subprocess.run([shutil.which("g++") or "g++", *cmd, str(tmp_path / "plain.so")], capture_output=True,
                           text=True)
    assert plain.returncode != 0 and "multiple definition" in plain.stderr
    wrapped = subprocess.run([aoti_compile.symbolic_compile_env()["CXX"], *cmd, str(tmp_path / "wrapped.so")],
                             capture_output=True, text=True)
    assert wrapped.returncode == 0, wrapped.stderr
