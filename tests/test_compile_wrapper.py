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


@pytest.mark.skipif(shutil.which("ld") is None or shutil.which("objcopy") is None, reason="needs binutils")
def test_kernels_sharing_one_cubin_each_get_their_own_embedded_symbols(tmp_path: Path) -> None:
    # Two kernel names whose code compiled to one content-named cubin (one Triton
    # kernel called from several layers): both symbols must end up in the link.
    from torch._inductor import codecache

    saved = getattr(codecache, "convert_cubin_to_obj", None)
    if saved is None:
        pytest.skip("this torch embeds cubins another way")
    cubin = tmp_path / "shared.cubin"
    cubin.write_bytes(b"\x7fELF kernel image" * 64)
    try:
        aoti_compile.embed_each_kernel_in_its_own_object()
        objects = [codecache.convert_cubin_to_obj(str(cubin), name, "ld", "objcopy") for name in ("_k_1", "_k_2")]
    finally:
        codecache.convert_cubin_to_obj = saved
    assert len(set(objects)) == 2
    lib = tmp_path / "kernels.so"
    subprocess.run([aoti_compile.symbolic_compile_env()["CXX"], "-shared", *objects, "-o", str(lib)], check=True)
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                             check=True).stdout
    for name in ("_k_1", "_k_2"):
        assert f"__{name}_start" in symbols and f"__{name}_end" in symbols
