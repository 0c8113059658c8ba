"""AOTInductor compilation of the bound program: a shared object of kernels, and its weights."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

import torch
from torch.export import ExportedProgram

from offgraph_kv.backend.switches import switch
from offgraph_kv.backend.weights import CollectedWeight, load_collected


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


def _symbolic_wrapper() -> str:
    """A g++ that links shared objects with -Bsymbolic.

    On the H200 image libtorch exports std::regex instantiations built with
    another libstdc++; without -Bsymbolic they interpose on the wrapper's own and
    creating the model container recurses forever inside parse_device_str (CUDA
    and CPU code alike). Elsewhere the flag only binds the wrapper's own symbols
    locally, which is what a self-contained program wants anyway.

    One path for every compile: inductor keys its precompiled headers (~150 MB
    each, in its global cache) on the compile command, compiler path included,
    so a wrapper per compile rebuilt and left behind two headers per program.
    """
    real = shutil.which("g++") or "g++"
    # -fno-gnu-unique: g++ emits template and inline statics as STB_GNU_UNIQUE,
    # which the dynamic linker binds process-wide: two programs loaded side by
    # side would share one instance of each (inductor's error flag among them).
    # The link that writes $OFFGRAPH_KV_LINK_INTO (the program's shared object)
    # also takes $OFFGRAPH_KV_LINK_OBJECT, our own kernels (cpu_kernels.py);
    # inductor's other links (ISA probes) stay as they are.
    script = (
        "#!/bin/sh\n"
        'shared=; into=; prev=\n'
        'for a in "$@"; do\n'
        '  [ "$a" = "-shared" ] && shared=1\n'
        '  [ "$prev" = "-o" ] && [ -n "$OFFGRAPH_KV_LINK_INTO" ] && [ "$a" = "$OFFGRAPH_KV_LINK_INTO" ] && into=1\n'
        '  prev=$a\n'
        'done\n'
        '[ -n "$shared" ] && [ -n "$into" ] && exec "%s" "$@" "$OFFGRAPH_KV_LINK_OBJECT" -fno-gnu-unique -Wl,-Bsymbolic\n'
        '[ -n "$shared" ] && exec "%s" "$@" -fno-gnu-unique -Wl,-Bsymbolic\n'
        'exec "%s" "$@" -fno-gnu-unique\n'
    ) % (real, real, real)
    wrapper = os.path.join(inductor_cache_dir(), "g++-bsymbolic")
    try:
        with open(wrapper) as f:
            if f.read() == script:
                return wrapper
    except OSError:
        pass
    # Written beside and renamed into place: a concurrent compile never runs a half-written script.
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(wrapper))
    with os.fdopen(fd, "w") as f:
        f.write(script)
    os.chmod(tmp, 0o755)
    os.replace(tmp, wrapper)
    return wrapper


def embed_each_kernel_in_its_own_object() -> None:
    """Give every embedded GPU kernel its own object file (this process's inductor).

    torch 2.11 embeds a kernel's cubin by converting it to ``<cubin>.o`` with
    symbols named after the kernel (``convert_cubin_to_obj``). Kernels of
    identical code (one Triton kernel called from many layers, under several
    names) share one content-named cubin, so each conversion overwrote the
    previous kernel's object: the link listed one object twice ("multiple
    definition of ___update_attend_partial_9_start") or, once deduplicated,
    left the other names undefined at load. Converting a copy per kernel name
    fixes both. Newer torch batches the cubins into one object and needs nothing.
    """
    from torch._inductor import codecache

    convert = getattr(codecache, "convert_cubin_to_obj", None)
    if convert is None or getattr(convert, "_offgraph_kv", False):
        return

    def convert_own_copy(cubin_file: str, kernel_name: str, *args, **kwargs) -> str:  # noqa: ANN002, ANN003
        # Named by a digest of the kernel's name: inductor's descriptive names of fused kernels run past
        # the file system's 255 bytes (an fp32 ring layer's attention: "File name too long").
        own = f"{cubin_file}.{hashlib.sha256(kernel_name.encode()).hexdigest()[:20]}.cubin"
        shutil.copyfile(cubin_file, own)
        return convert(own, kernel_name, *args, **kwargs)

    convert_own_copy._offgraph_kv = True  # type: ignore[attr-defined]
    codecache.convert_cubin_to_obj = convert_own_copy


_SUBPROCESS_COMPILE = """
import os, sys, torch
from offgraph_kv.backend.aoti_compile import embed_each_kernel_in_its_own_object
embed_each_kernel_in_its_own_object()
import executorch.exir.passes.dim_order_ops_registry  # ops edge dialect leaves in the graph
from offgraph_kv.backend.attention import COMPILE_DECOMPOSITIONS
import offgraph_kv.backend.triton_attention  # registers offgraph_kv::update_attend before the program loads
from offgraph_kv.backend.cpu_kernels import shim_options  # registers the CPU kernels' ops (rows_attend_causal, ...)
ep = torch.export.load(sys.argv[1])
if sys.argv[4] == "cuda":
    try:
        # Our Triton ops (triton_attention) become their kernels here; export keeps
        # them whole, and AOTI would otherwise call them back through a proxy executor.
        ep = ep.run_decompositions(COMPILE_DECOMPOSITIONS, decompose_custom_triton_ops=True)
    except TypeError:  # a torch without the flag
        ep = ep.run_decompositions(COMPILE_DECOMPOSITIONS)
else:
    # AOTInductor traces the program again with its own decomposition table;
    # adding ours there spares a whole trace of its own (a fifth of a 30-layer
    # model's export on 2 cores).
    from torch._inductor.decomposition import decompositions as _inductor_decompositions
    _inductor_decompositions.update(COMPILE_DECOMPOSITIONS)
args = torch.load(sys.argv[2])
options = torch.load(sys.argv[3])
if sys.argv[4] == "cpu":
    options.update(shim_options())  # op handles do not pickle: added on this side
module = ep.module()
if os.environ.get("OFFGRAPH_KV_LINEAR_TEMPLATE_ONLY") == "1":
    # Linears: inductor's C++ GEMM template only (aoti_compile.cpu_linear_options
    # says why); mkldnn_lowerings adds oneDNN's packed linear when ATen GEMMs are
    # allowed, or when the template does not take the linear (then collect_weights
    # names the opaque weight it cannot store).
    import torch._inductor.mkldnn_lowerings as _mkldnn_lowerings
    _mkldnn_lowerings.use_aten_gemm_kernels = lambda: False
# Constants that freezing makes (a weight packed for inductor's GEMM template,
# a parameter renamed _frozen_paramN) name no tensor of the module: their values
# are taken from the graph AOTInductor writes out (collect_weights' `derived`).
derived = {}
from torch._inductor.codecache import AotCodeCompiler
_aot_compile = AotCodeCompiler.compile.__func__
def _keep_constants(cls, graph, *a, **k):
    derived.update(graph.constants)
    return _aot_compile(cls, graph, *a, **k)
AotCodeCompiler.compile = classmethod(_keep_constants)
with torch.no_grad():
    path = torch._inductor.aot_compile(module, tuple(args), options=options)
path = path if isinstance(path, str) else [p for p in path if p.endswith(".so")][0]
index = ""
if not options["aot_inductor.package_constants_in_so"]:
    from offgraph_kv.backend.weights import collect_weights
    index = collect_weights(path, sys.argv[4], module, sys.argv[5], derived=derived)
print(path)
print(index)
"""


# How a CPU program's linear layers (GEMMs with a weight) are compiled:
# "cpp": inductor's C++ GEMM template, weights packed at compile time (freezing);
# "aten": an extern call to ATen's mm (MKL sgemm for fp32, oneDNN for bf16).
CPU_LINEAR_ENV = "OFFGRAPH_KV_CPU_LINEAR"
CPU_LINEAR_KERNELS = ("cpp", "aten")
DEFAULT_CPU_LINEAR = "aten"


def cpu_linear_kernel() -> str:
    """The CPU linear kernel of this export: ``$OFFGRAPH_KV_CPU_LINEAR`` or the default."""
    return switch(CPU_LINEAR_ENV, CPU_LINEAR_KERNELS, DEFAULT_CPU_LINEAR)


def cpu_linear_options(kind: "str | None" = None) -> dict:
    """AOTInductor options for ``kind`` (``cpu_linear_kernel()`` when None).

    "cpp" (opt-in, ``OFFGRAPH_KV_CPU_LINEAR=cpp``): on this machine (AMD Zen,
    AVX-512 without inductor's bf16 micro-kernel) ATen's one-row fp32 GEMMs
    read the weights at a third of what one core streams; inductor's GEMM
    template over weights it packs in 48-column blocks reads them about twice
    as fast for one row, but is ~20 % slower than MKL for 64 rows (prefill),
    and for bf16 weights it is no faster for one row and 2-5x slower for 64
    (``benchmarks/cpu/gemv.py``, ``benchmarks/results/cpu_gemv.md``). Hence
    not the default. The template needs the weights as compile-time constants
    (freezing) to pack them; the packed copies are what the .pte stores
    (``weights.collect_weights``' derived constants), so a tied embedding is
    stored twice (the table for the lookup, packed for the output
    projection). The template is compiled serial (``cpp.threads=1``): a
    prefill step given more threads runs its GEMMs on one.
    The template is only offered with ``cpp.weight_prepack``, whose other
    choice for a linear is oneDNN's packed linear: as fast for one row, but
    its weights are opaque tensors the runtime cannot bind from the file's
    bytes. So the compile process drops ATen's choice for linears
    (``_SUBPROCESS_COMPILE``, ``OFFGRAPH_KV_LINEAR_TEMPLATE_ONLY``), which
    also keeps the choice deterministic (no timing on a busy machine picks
    the kernel); other GEMMs (attention's ``bmm`` over the KV) keep ATen.
    """
    kind = kind or cpu_linear_kernel()
    if kind == "aten":
        return {}
    return {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
            "cpp.weight_prepack": True}


def inductor_cache_dir() -> str:
    """Inductor's cache for our compiles: kept between compiles (precompiled
    headers and kernels are reused) but apart from the default one, whose
    objects may have been linked without -Bsymbolic."""
    # v2: objects built with -fno-gnu-unique; older cached objects must not be reused.
    default = os.path.join(tempfile.gettempdir(), f"offgraph_kv_inductor_v2_{os.getuid()}")
    path = os.environ.get("OFFGRAPH_KV_INDUCTOR_CACHE", default)
    os.makedirs(path, exist_ok=True)
    return path


def symbolic_compile_env() -> dict:
    """Environment for a fresh process whose AOTInductor compiles link with
    -Bsymbolic (see ``_symbolic_wrapper``) into our private inductor cache."""
    return dict(os.environ, CXX=_symbolic_wrapper(), TORCHINDUCTOR_CACHE_DIR=inductor_cache_dir())


def _compile_in_fresh_process(program: ExportedProgram, example_args: Sequence[torch.Tensor], options: dict,
                              workdir: str, device: str, template_linears: bool = False) -> Tuple[str, str]:
    """Compile in a process whose inductor starts with the symbolic linker.

    Inductor reads $CXX at import and keeps compiled objects in its cache, so
    patching a running process is not enough.
    """
    import subprocess
    import sys

    ep_path, args_path, opt_path = (os.path.join(workdir, n) for n in ("program.pt2", "args.pt", "options.pt"))
    torch.export.save(program, ep_path)
    torch.save(list(example_args), args_path)
    torch.save(options, opt_path)
    env = symbolic_compile_env()
    if device == "cpu":
        from offgraph_kv.backend.cpu_kernels import build_object

        env["OFFGRAPH_KV_LINK_INTO"] = options["aot_inductor.output_path"]
        env["OFFGRAPH_KV_LINK_OBJECT"] = build_object(inductor_cache_dir(), shutil.which("g++") or "g++")
    env["OFFGRAPH_KV_LINEAR_TEMPLATE_ONLY"] = "1" if template_linears else "0"
    done = subprocess.run([sys.executable, "-c", _SUBPROCESS_COMPILE, ep_path, args_path, opt_path, device, workdir],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"AOTInductor compile failed:\n{done.stderr[-4000:]}")
    so_path, index = done.stdout.splitlines()[-2:]
    return so_path.strip(), index.strip()


@dataclass
class CompiledCode:
    """The compiled shared object and, when they are kept outside it, its weights."""

    so_bytes: bytes
    weights: List[CollectedWeight] = field(default_factory=list)


def compile_shared_object(program: ExportedProgram, example_args: Sequence[torch.Tensor], device: str,
                          weights_in_code: bool = False) -> CompiledCode:
    """Compile ``program``: the shared object (kernels inside) and its weights.

    By default the weights stay out of the shared object (``weights.py`` says
    why and where they go); ``weights_in_code=True`` compiles them in, as
    before (programs up to ~2 GB; kept for comparison).
    """
    outdir = tempfile.mkdtemp(prefix="offgraph_kv_aoti_")
    options = {
        "aot_inductor.package": False,
        "aot_inductor.package_constants_in_so": weights_in_code,
        "aot_inductor.output_path": os.path.join(outdir, "program.so"),
        # Export specialises sizes 0 and 1 away and would reject a one-token step
        # or a one-row cache; the program is correct for them.
        "aot_inductor.check_lowerbound": False,
    }
    if device == "cpu":
        # Inductor's own CPU kernels stay serial; the runtime decides the threads
        # of what parallelises (ATen's kernels: MKL / oneDNN GEMMs, the fused
        # attention), per step (runtime/src/step_threads.h, option num_threads).
        # Left to its default, inductor bakes the compiling process's thread
        # count N into the code: `num_threads(N)` clauses that ignore the
        # runtime's setting (N threads even for a decode step), or, when N was
        # that machine's core count, per-thread reduction arrays of N entries
        # indexed by the thread id, written out of bounds by a run with more
        # threads. cpp.dynamic_threads fixes both but opens a parallel region in
        # every kernel, and a kernel's bounds check (a token id past the
        # vocabulary) that throws inside one aborts the process instead of
        # failing the step.
        options["cpp.threads"] = 1
        template_linears = cpu_linear_kernel() == "cpp"
        options.update(cpu_linear_options("cpp" if template_linears else "aten"))
    else:
        template_linears = False
    if device == "cuda":
        # Otherwise the .so loads its GPU kernels from cubin files in the
        # compile's cache directory at run time: gone on any other machine.
        options["aot_inductor.embed_kernel_binary"] = True
    try:
        path, index = _compile_in_fresh_process(program, example_args, options, outdir, device, template_linears)
        with open(path, "rb") as f:
            so_bytes = f.read()
        return CompiledCode(so_bytes, load_collected(index) if index else [])
    finally:
        shutil.rmtree(outdir, ignore_errors=True)
