"""AOTInductor compilation of the bound program into one self-contained shared object."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch.export import ExportedProgram


def target_of(device: str) -> str:
    """The code target recorded in the manifest and checked again at load.

    AOTI CPU code is compiled for the exporting machine's vector ISA, so code
    compiled with AVX-512 must not be run where AVX-512 is missing.
    """
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        return f"cuda:sm_{major}{minor}"
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = str(pick_vec_isa()) or "scalar"
    return f"cpu:{isa}"


@contextmanager
def _symbolic_linking() -> Iterator[None]:
    """Link the wrapper .so with -Bsymbolic (CUDA only).

    On the H200 image libtorch exports std::regex instantiations built with
    another libstdc++; without -Bsymbolic they interpose on the wrapper's own and
    loading the package recurses forever inside parse_device_str.
    """
    workdir = tempfile.mkdtemp(prefix="offgraph_kv_cxx_")
    from torch._inductor import config as inductor_config

    real = shutil.which(inductor_config.cpp.cxx[1] or "g++") or shutil.which("g++") or "g++"
    wrapper = os.path.join(workdir, "g++")
    with open(wrapper, "w") as f:
        f.write(
            "#!/bin/sh\n"
            f'for a in "$@"; do [ "$a" = "-shared" ] && exec "{real}" "$@" -Wl,-Bsymbolic; done\n'
            f'exec "{real}" "$@"\n'
        )
    os.chmod(wrapper, os.stat(wrapper).st_mode | stat.S_IEXEC)
    # Inductor reads $CXX when its config is imported, and compile workers read
    # it when they start; cached objects from an earlier, non-symbolic build
    # must not be reused. So: the config, the environment, in-process compiles
    # and a private cache directory, for the duration of this compile.
    from torch._inductor import config as inductor_config

    saved = {k: os.environ.get(k) for k in ("CXX", "TORCHINDUCTOR_CACHE_DIR")}
    os.environ["CXX"] = wrapper
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(workdir, "cache")
    try:
        with inductor_config.patch({"cpp.cxx": (None, wrapper), "compile_threads": 1}):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(workdir, ignore_errors=True)


def compile_shared_object(program: ExportedProgram, example_args: Sequence[torch.Tensor], device: str) -> bytes:
    """Compile ``program`` and return the bytes of its shared object (weights inside)."""
    outdir = tempfile.mkdtemp(prefix="offgraph_kv_aoti_")
    options = {
        "aot_inductor.package": False,
        # Weights travel inside the .so, the one artifact the runtime loads.
        "aot_inductor.package_constants_in_so": True,
        "aot_inductor.output_path": os.path.join(outdir, "program.so"),
        # Export specialises sizes 0 and 1 away and would reject a one-token step
        # or a one-row cache; the program is correct for them.
        "aot_inductor.check_lowerbound": False,
    }
    guard = _symbolic_linking() if device == "cuda" else _nullcontext()
    try:
        with guard, torch.no_grad():
            path = torch._inductor.aot_compile(program.module(), tuple(example_args), options=options)
        if isinstance(path, (list, tuple)):
            path = next(p for p in path if p.endswith(".so"))
        with open(path, "rb") as f:
            return f.read()
    finally:
        shutil.rmtree(outdir, ignore_errors=True)


@contextmanager
def _nullcontext() -> Iterator[None]:
    yield
