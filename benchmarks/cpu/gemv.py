"""Decode GEMV through AOTInductor on CPU: one linear layer, compiled per candidate knob, GB/s side by side.

    python -m benchmarks.cpu.gemv [--dtypes float32,bfloat16] [--variants aten,cpp_gemm,prepack,reduction] [--widths 1,64]
    python -m benchmarks.cpu.gemv --eager-only        # plain ATen calls (F.linear, mv, addmm, packed) instead

Each candidate compiles SmolLM2's linear shapes (576->576, 576->192,
576->1536, 1536->576, 576->49152) with AOTInductor, the options
``backend/aoti_compile.py`` uses (serial inductor kernels, dynamic width
1..64) plus the candidate's own, in a compile process of its own. One module
per shape holds enough copies of the weight to pass the last-level cache (48
MiB), as the model's 30 layers do, so every GEMV reads its weight from DRAM.
All programs are then run in one process, one thread, interleaved round by
round (the cores are shared with other jobs); reported: the median time per
GEMV and the weight bytes it read per second.

Candidates:

- ``aten``: the backend's options today (extern ``mm``: MKL sgemm for fp32,
  oneDNN for bf16);
- ``cpp_gemm``: ``max_autotune`` with ``max_autotune_gemm_backends="CPP,ATEN"``
  and freezing (inductor's C++ GEMM template, weights packed at compile time);
- ``prepack``: freezing with ``cpp.weight_prepack`` (mkldnn / MKL packed linear);
- ``reduction``: the linear written as ``(x[:, None, :] * w).sum(-1)`` in fp32,
  which inductor compiles to its own vectorised reduction (no extern call);
- ``kernel``: our kernel (``offgraph_kv::linear_rows``, ``backend/native/decode_linear.cpp``),
  linked into the program as every CPU export links it (what one-row linears
  run in the default mode).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

SHAPES: List[Tuple[int, int]] = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]
MAX_WIDTH = 64
PASS_CACHE_BYTES = 48 << 20
VARIANTS = ("aten", "cpp_gemm", "prepack", "reduction", "kernel")

_COMPILE = r"""
import json, sys, torch
from torch import nn
spec = json.loads(sys.argv[1])
dtype = getattr(torch, spec["dtype"])
K, N, R = spec["k"], spec["n"], spec["copies"]

class Reduction(nn.Module):
    # y[t, n] = sum_k x[t, k] * w[n, k] in fp32, as inductor's own kernel.
    def __init__(self, lin):
        super().__init__()
        self.weight = lin.weight
    def forward(self, x):
        return (x[:, None, :].float() * self.weight.float()).sum(-1).to(x.dtype)

class Kernel(nn.Module):
    # Our decode-linear kernel, called by the generated code as a C function.
    def __init__(self, lin):
        super().__init__()
        self.weight = lin.weight
    def forward(self, x):
        return torch.ops.offgraph_kv.linear_rows(x, self.weight)

WRAP = {"reduction": Reduction, "kernel": Kernel}

class Copies(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        lins = []
        for _ in range(R):
            lin = nn.Linear(K, N, bias=False)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(N, K, generator=g) / K ** 0.5)
            lins.append(WRAP.get(spec["variant"], lambda l: l)(lin))
        self.lins = nn.ModuleList(lins)
    def forward(self, x):
        return tuple(l(x) for l in self.lins)

import offgraph_kv.backend.cpu_kernels  # registers offgraph_kv::linear_rows
m = Copies().to(dtype).eval()
x = torch.randn(4, K, dtype=dtype)
t = torch.export.Dim("t", min=1, max=spec["max_width"])
with torch.no_grad():
    ep = torch.export.export(m, (x,), dynamic_shapes={"x": {0: t}})
    options = dict(spec["options"])
    options["aot_inductor.output_path"] = spec["out"]
    if spec["variant"] == "kernel":
        from offgraph_kv.backend.cpu_kernels import shim_options
        options.update(shim_options())
    path = torch._inductor.aot_compile(ep.module(), (x,), options=options)
print(path if isinstance(path, str) else [p for p in path if p.endswith(".so")][0])
"""


def variant_options(variant: str) -> Dict[str, object]:
    """AOTInductor options: the backend's CPU options plus the candidate's."""
    base: Dict[str, object] = {"aot_inductor.package": False, "aot_inductor.package_constants_in_so": True,
                               "aot_inductor.check_lowerbound": False, "cpp.threads": 1}
    if variant == "cpp_gemm":
        base.update({"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN", "freezing": True})
    elif variant == "prepack":
        base.update({"freezing": True, "cpp.weight_prepack": True})
    return base


def compile_one(variant: str, dtype: str, k: int, n: int, outdir: Path, reuse: bool = False) -> Dict[str, object]:
    from offgraph_kv.backend.aoti_compile import symbolic_compile_env

    esize = 2 if dtype == "bfloat16" else 4
    copies = max(1, -(-PASS_CACHE_BYTES // (k * n * esize)))
    out = outdir / f"{variant}_{dtype}_{k}x{n}.so"
    if reuse and out.exists():
        return {"so": str(out), "copies": copies, "compile_s": float("nan")}
    spec = {"variant": variant, "dtype": dtype, "k": k, "n": n, "copies": copies, "max_width": MAX_WIDTH,
            "options": variant_options(variant), "out": str(out)}
    env = symbolic_compile_env()
    if variant == "kernel":  # the program's link takes our kernels' object, as an export's does
        from offgraph_kv.backend.aoti_compile import inductor_cache_dir
        from offgraph_kv.backend.cpu_kernels import build_object

        env.update(OFFGRAPH_KV_LINK_INTO=str(out), OFFGRAPH_KV_LINK_OBJECT=build_object(inductor_cache_dir()))
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(spec)], capture_output=True, text=True,
                          env=env)
    took = time.perf_counter() - t0
    if done.returncode != 0:
        return {"error": done.stderr[-1500:], "compile_s": took}
    return {"so": done.stdout.strip().splitlines()[-1], "copies": copies, "compile_s": took}


def kernel_in(so: str) -> str:
    """Which GEMM the compiled code calls: autotuning may pick oneDNN's packed linear over the template."""
    data = Path(so).read_bytes()
    if b"_linear_pointwise" in data:
        return "oneDNN packed linear"
    if b"CppMicroGemm" in data or b"micro_gemm" in data:
        return "C++ GEMM template"
    if b"aoti_torch_cpu_linear_rows" in data:
        return "offgraph-kv kernel"
    if b"aoti_torch_cpu_mm_out" in data or b"aoti_torch_cpu_addmm_out" in data:
        return "ATen mm"
    return "inductor kernel"


def run_all(built: Dict[str, Dict[str, object]], widths: List[int], rounds: int) -> Dict[str, Dict[str, object]]:
    """Every compiled program, interleaved: per round each program runs ``reps`` calls per width."""
    import torch

    torch.set_num_threads(1)
    runners, inputs, refs = {}, {}, {}
    for key, b in built.items():
        if "so" not in b:
            continue
        runners[key] = torch._C._aoti.AOTIModelContainerRunnerCpu(b["so"], 1)
    times: Dict[Tuple[str, int], List[float]] = {(k, w): [] for k in runners for w in widths}
    for _ in range(rounds):
        for key, r in runners.items():
            b = built[key]
            dtype = getattr(torch, b["dtype"])
            for w in widths:
                x = torch.randn(w, b["k"], generator=torch.Generator().manual_seed(w)).to(dtype)
                reps = max(2, int(2e7 // (b["k"] * b["n"] * b["copies"] * (2 if dtype == torch.bfloat16 else 4)) + 1))
                r.run([x])  # warm
                t0 = time.perf_counter()
                for _ in range(reps):
                    out = r.run([x])
                times[(key, w)].append((time.perf_counter() - t0) / reps / b["copies"])
                if (key, w) not in refs:
                    refs[(key, w)] = out[0].float()
                    inputs[(key, w)] = x
    result: Dict[str, Dict[str, object]] = {}
    for (key, w), ts in times.items():
        b = built[key]
        nbytes = b["k"] * b["n"] * (2 if b["dtype"] == "bfloat16" else 4)
        med = statistics.median(ts)
        entry = result.setdefault(key, {k: b[k] for k in ("variant", "dtype", "k", "n", "copies", "compile_s")})
        entry["kernel"] = kernel_in(b["so"])
        entry[f"us_w{w}"] = med * 1e6
        entry[f"gbs_w{w}"] = nbytes / med / 1e9
    # Correctness of each program against fp32 math on the same weights is the
    # model tests' job; here only the outputs of candidates agree with aten's.
    for key in result:
        base = key.replace(built[key]["variant"], "aten", 1)
        if base in runners and base != key:
            for w in widths:
                a, b_ = refs[(key, w)], refs[(base, w)]
                result[key][f"max_abs_diff_vs_aten_w{w}"] = float((a - b_).abs().max())
    return result


def eager_aten(dtypes: List[str], rounds: int) -> Dict[str, Dict[str, float]]:
    """Plain ATen calls in eager mode over the same shapes (weights rotated past the cache), one row:
    ``F.linear``, ``torch.mv``, ``torch.addmm``, and oneDNN's packed linear
    (``torch.ops.mkldnn._linear_pointwise`` over ``_reorder_linear_weight``, bf16) / MKL's packed
    sgemm (``torch.ops.mkl._mkl_linear``, fp32) for comparison with the compiled programs."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    out: Dict[str, Dict[str, float]] = {}
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        for k, n in SHAPES:
            nbytes = k * n * (2 if dt == torch.bfloat16 else 4)
            copies = max(1, -(-PASS_CACHE_BYTES // nbytes))
            ws = [torch.randn(n, k).to(dt) for _ in range(copies)]
            x = torch.randn(1, k).to(dt)
            zero = torch.zeros(1, n, dtype=dt)
            fns = {"F.linear": lambda i: F.linear(x, ws[i]), "torch.mv": lambda i: torch.mv(ws[i], x[0]),
                   "torch.addmm": lambda i: torch.addmm(zero, x, ws[i].t())}
            if dt == torch.bfloat16:
                packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in ws]
                fns["mkldnn packed linear"] = lambda i: torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none",
                                                                                            [], "")
            else:
                packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, 1) for w in ws]
                fns["mkl packed linear"] = lambda i: torch.ops.mkl._mkl_linear(x, packed[i], ws[i], None, 1)
            times: Dict[str, List[float]] = {f: [] for f in fns}
            for _ in range(rounds):
                for f, fn in fns.items():
                    fn(0)
                    t0 = time.perf_counter()
                    for i in range(copies):
                        fn(i)
                    times[f].append((time.perf_counter() - t0) / copies)
            for f, ts in times.items():
                med = statistics.median(ts)
                out[f"{f}/{dtype}/{k}x{n}"] = {"op": f, "dtype": dtype, "k": k, "n": n, "us_w1": med * 1e6,
                                               "gbs_w1": nbytes / med / 1e9}
            del ws, packed
    return out


def eager_table(rows: Dict[str, Dict[str, float]]) -> str:
    lines = ["| dtype | shape K->N | eager ATen op | T=1: us / GB/s |", "|---|---|---|---:|"]
    lines += [f"| {e['dtype']} | {e['k']}->{e['n']} | {e['op']} | {e['us_w1']:.1f} / {e['gbs_w1']:.1f} |"
              for e in rows.values()]
    return "\n".join(lines) + "\n"


def table(result: Dict[str, Dict[str, object]], widths: List[int]) -> str:
    head = "| dtype | shape K->N | variant | kernel | " + " | ".join(f"T={w}: us / GB/s" for w in widths) + " |\n"
    head += "|---|---|---|---|" + "---:|" * len(widths) + "\n"
    rows = sorted(result.values(), key=lambda e: (e["dtype"], SHAPES.index((e["k"], e["n"])), VARIANTS.index(e["variant"])))
    lines = [f"| {e['dtype']} | {e['k']}->{e['n']} | {e['variant']} | {e['kernel']} | "
             + " | ".join(f"{e[f'us_w{w}']:.1f} / {e[f'gbs_w{w}']:.1f}" for w in widths) + " |" for e in rows]
    return head + "\n".join(lines) + "\n"


def main(argv: "List[str] | None" = None) -> int:
    from benchmarks.lib.machine import describe, now_utc
    from benchmarks.lib.paths import RESULTS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    p.add_argument("--widths", default="1,64")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--eager-only", action="store_true", help="only the eager ATen ops (no compiles)")
    p.add_argument("--reuse", action="store_true", help="programs already compiled into --workdir are not compiled again")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / f"offgraph_kv_gemv_{os.getuid()}")
    p.add_argument("--out", type=Path, default=RESULTS / "cpu_gemv.json")
    a = p.parse_args(argv)
    a.workdir.mkdir(parents=True, exist_ok=True)
    if a.eager_only:
        rows = eager_aten(a.dtypes.split(","), a.rounds)
        out_path = a.out.with_name(a.out.stem + "_eager.json")
        out_path.write_text(json.dumps({"date": now_utc(), "machine": describe(), "threads": 1, "rows": rows}, indent=1))
        md = eager_table(rows)
        out_path.with_suffix(".md").write_text(f"### Decode GEMV, eager ATen ({now_utc()})\n\n"
                                               "`python -m benchmarks.cpu.gemv --eager-only`, one thread, weights "
                                               "rotated past the last-level cache.\n\n" + md)
        print(md)
        return 0
    widths = [int(w) for w in a.widths.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    built: Dict[str, Dict[str, object]] = {}
    for dtype in a.dtypes.split(","):
        for k, n in shapes:
            for v in a.variants.split(","):
                key = f"{v}/{dtype}/{k}x{n}"
                b = compile_one(v, dtype, k, n, a.workdir, a.reuse)
                b.update(variant=v, dtype=dtype, k=k, n=n)
                print(key, "compiled" if "so" in b else "FAILED", f"{b['compile_s']:.0f}s", flush=True)
                if "error" in b:
                    print(b["error"][-600:], flush=True)
                built[key] = b
    result = run_all(built, widths, a.rounds)
    failed = {k: b["error"] for k, b in built.items() if "error" in b}
    out = {"date": now_utc(), "machine": describe(), "threads": 1, "widths": widths, "rows": result,
           "failed": failed}
    a.out.write_text(json.dumps(out, indent=1))
    md = table(result, widths)
    a.out.with_suffix(".md").write_text(f"### Decode GEMV through AOTInductor ({out['date']})\n\n"
                                        "`python -m benchmarks.cpu.gemv`, one thread, weights read from DRAM.\n\n"
                                        + md)
    print(md)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
