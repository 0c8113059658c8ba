"""How close the CPU decode attention reads the KV history to this machine's
read bandwidth, per storage dtype (issue 17: where decode time goes at long
context).

    python -m benchmarks.cpu.attention_bandwidth --contexts 200,2000,8000 \
        --out benchmarks/results/cpu_attention_bandwidth.json

SmolLM2-135M's attention shapes (30 layers, 9 query heads over 3 KV heads of
64), one decode step's attention over every layer's history, one thread, each
layer's K/V in the store's own layout (``[1, capacity, H_kv, D]``, read as the
first ``context`` rows). What runs is what the compiled CPU program runs:

- fp32 storage: ``fused_attention_with_lse`` (ATen's fused CPU attention, the
  op the program falls back to);
- bf16 / fp16 storage: ``reduced_attention_with_lse`` and
  ``grouped_decode_attention_with_lse`` compiled by inductor's CPU backend
  (the same C++ code generation as AOTInductor).

- any storage: our kernel over the stored rows, what the program calls for a
  decode step by default (``offgraph_kv::rows_attend_with_lse``,
  ``backend/native/decode_attention.cpp``), compiled by AOTInductor into a
  program of all 30 layers' calls as an export links it, so no Python runs
  between layers.

Beside them, in the same run: the machine's single-thread read bandwidth (a
sum over a buffer far larger than the caches). Every variant is checked
against ATen's fp32 result. Reported per variant and context: ms per step
(all layers), KV bytes read per step, GB/s, and the ratio to the read
bandwidth (the hardware limit). Variants run in turns, so load from other
jobs lands on all of them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from offgraph_kv.backend import attention as attn

from benchmarks.lib.machine import Contention, describe, now_utc
from benchmarks.lib.plots import finish_plot

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
GROUPS = Q_HEADS // KV_HEADS
SCALE = HEAD_DIM ** -0.5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Single-thread read bandwidth in GB/s: the best of ``repeats`` sums over ``mib`` MiB."""
    buf = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best / 1e9


def _fp32_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.ops.offgraph_kv.attend_with_lse(q, k, v, SCALE)[0]


def _direct_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return attn.reduced_attention_with_lse(q, k, v, SCALE)[0]


def _grouped_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return attn.grouped_decode_attention_with_lse(q, k, v, SCALE, GROUPS)[0]


class _KernelStep(torch.nn.Module):
    """One decode step's attention over every layer through our kernel."""

    def forward(self, q: torch.Tensor, *stores: torch.Tensor) -> List[torch.Tensor]:
        # Flat arguments (every layer's K, then every layer's V): what the compile hands AOTInductor.
        ks, vs = stores[:LAYERS], stores[LAYERS:]
        return [torch.ops.offgraph_kv.rows_attend_with_lse(q, k.transpose(1, 2), v.transpose(1, 2), SCALE)[0]
                for k, v in zip(ks, vs)]


def shipped_kernel(dtype: torch.dtype) -> Callable[..., List[torch.Tensor]]:
    """Our kernel as a CPU program links it: ``fn(q, ks, vs)`` over all layers'
    ``[1, S, H_kv, D]`` stores (S dynamic), one AOTInductor call per step."""
    import tempfile

    from torch.export import Dim

    from offgraph_kv.backend.aoti_compile import compile_shared_object

    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, KV_HEADS, GROUPS, HEAD_DIM, generator=g)
    ks, vs = ([torch.randn(1, 16, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(LAYERS)]
              for _ in range(2))
    rows = Dim("rows", min=1, max=1 << 20)
    program = torch.export.export(_KernelStep(), (q, *ks, *vs), dynamic_shapes=(None, ({1: rows},) * (2 * LAYERS)))
    code = compile_shared_object(program, [q, *ks, *vs], "cpu")
    path = Path(tempfile.mkdtemp(prefix="offgraph_kv_bench_")) / "kernel.so"
    path.write_bytes(code.so_bytes)
    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)
    return lambda q, ks, vs: runner.run([q, *ks, *vs])


def variants(dtypes: List[str], kernel: bool) -> Dict[str, Callable[..., torch.Tensor]]:
    """name -> one layer's decode attention (``whole_step``: all layers' at once), per storage dtype."""
    out: Dict[str, Callable[..., torch.Tensor]] = {}
    for name in dtypes:
        if kernel:
            step = shipped_kernel(DTYPES[name])
            step.whole_step = True  # type: ignore[attr-defined]
            out[f"{name} rows kernel (default)"] = step
        if name == "fp32":
            out["fp32 fused (ATen)"] = _fp32_step
        else:
            # dynamic=True: one compiled kernel for every context, as the program's symbolic length.
            out[f"{name} direct"] = torch.compile(_direct_step, dynamic=True)
            out[f"{name} grouped"] = torch.compile(_grouped_step, dynamic=True)
    return out


class Layers:
    """Every layer's K/V store of one dtype and the step's folded queries."""

    def __init__(self, dtype: torch.dtype, capacity: int) -> None:
        g = torch.Generator().manual_seed(0)
        shape = (1, capacity, KV_HEADS, HEAD_DIM)
        self.k = [torch.randn(shape, generator=g).to(dtype) for _ in range(LAYERS)]
        self.v = [torch.randn(shape, generator=g).to(dtype) for _ in range(LAYERS)]
        self.q = torch.randn(1, KV_HEADS, GROUPS, HEAD_DIM, generator=g)  # one token's queries, folded per KV head

    def step(self, fn: Callable[..., torch.Tensor], context: int) -> float:
        """Seconds for one decode step's attention over all layers at ``context`` rows."""
        if getattr(fn, "whole_step", False):
            ks, vs = [k[:, :context] for k in self.k], [v[:, :context] for v in self.v]
            t = time.perf_counter()
            fn(self.q, ks, vs)
            return time.perf_counter() - t
        t = time.perf_counter()
        for k, v in zip(self.k, self.v):
            fn(self.q, k[:, :context].transpose(1, 2), v[:, :context].transpose(1, 2))
        return time.perf_counter() - t


def kv_bytes(dtype: torch.dtype, context: int) -> int:
    return 2 * LAYERS * context * KV_HEADS * HEAD_DIM * torch.empty((), dtype=dtype).element_size()


def max_error(fn: Callable[..., torch.Tensor], layers: Layers, context: int) -> float:
    """How far a variant's output is from ATen's fp32 attention over the same rows, widened."""
    k = layers.k[0][:, :context].transpose(1, 2)
    v = layers.v[0][:, :context].transpose(1, 2)
    ref = _fp32_step(layers.q, k.float(), v.float())
    if getattr(fn, "whole_step", False):
        got = fn(layers.q, [x[:, :context] for x in layers.k], [x[:, :context] for x in layers.v])[0]
    else:
        got = fn(layers.q, k, v)
    return (got.float().reshape(ref.shape) - ref).abs().max().item()


def measure(contexts: List[int], dtypes: List[str], turns: int, steps: int, kernel: bool) -> Dict[str, object]:
    torch.set_num_threads(1)
    fns = variants(dtypes, kernel)
    stores = {name: Layers(DTYPES[name], max(contexts)) for name in dtypes}
    store_of = {v: stores[v.split()[0]] for v in fns}
    errors = {v: max(max_error(fn, store_of[v], c) for c in contexts) for v, fn in fns.items()}
    for v, fn in fns.items():  # compile and warm at every context first
        for c in contexts:
            store_of[v].step(fn, c)
    times: Dict[str, Dict[int, List[float]]] = {v: {c: [] for c in contexts} for v in fns}
    bandwidth: List[float] = []
    contention = Contention()
    names = list(fns)
    for turn in range(turns):
        bandwidth.append(read_bandwidth())
        order = names[turn % len(names):] + names[:turn % len(names)]
        for c in contexts:
            for v in order:
                times[v][c] += [store_of[v].step(fns[v], c) for _ in range(steps)]
    bw = statistics.median(bandwidth)
    rows = []
    for v in names:
        dtype = DTYPES[v.split()[0]]
        for c in contexts:
            ms = statistics.median(times[v][c]) * 1e3
            gbs = kv_bytes(dtype, c) / (ms / 1e3) / 1e9
            rows.append({"variant": v, "context": c, "ms_per_step": ms, "kv_mib": kv_bytes(dtype, c) / 2**20,
                         "gb_per_s": gbs, "of_read_bandwidth": gbs / bw, "max_abs_error_vs_aten_fp32": errors[v]})
    return {"date": now_utc(), "machine": describe(), "read_bandwidth_gb_per_s": bw,
            "read_bandwidth_samples": bandwidth, "others_busy": contention.others_fraction(),
            "turns": turns, "steps": steps, "rows": rows}


def report(result: Dict[str, object]) -> str:
    lines = [f"single-thread read bandwidth {result['read_bandwidth_gb_per_s']:.1f} GB/s "
             f"(other processes kept {result['others_busy'] or 0:.0%} of the cores busy)",
             "| variant | context | ms / step (30 layers) | KV MiB read | GB/s | of read bandwidth | max error vs ATen fp32 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['variant']} | {r['context']:,} | {r['ms_per_step']:.2f} | {r['kv_mib']:.1f} "
                     f"| {r['gb_per_s']:.1f} | {r['of_read_bandwidth']:.0%} | {r['max_abs_error_vs_aten_fp32']:.1e} |")
    return "\n".join(lines)


def plot(result: Dict[str, object], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for v in dict.fromkeys(r["variant"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["variant"] == v]
        ax.plot([r["context"] for r in rows], [r["ms_per_step"] for r in rows], marker="o", label=v)
    ctx = sorted({r["context"] for r in result["rows"]})
    bw = result["read_bandwidth_gb_per_s"] * 1e9
    for name, dtype in (("fp32", torch.float32), ("16-bit", torch.bfloat16)):
        ax.plot(ctx, [kv_bytes(dtype, c) / bw * 1e3 for c in ctx], linestyle="--", label=f"{name} KV at read bandwidth")
    ax.set_xscale("log")
    return finish_plot(fig, ax, "context (tokens)", "attention ms per decode step (30 layers)",
                       "CPU decode attention vs read bandwidth (SmolLM2 shapes, 1 thread)", path)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="200,2000,8000")
    p.add_argument("--dtypes", default="fp32,bf16,fp16")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant, context and turn")
    p.add_argument("--no-kernel", action="store_true", help="leave out our kernel (an AOTInductor compile per dtype)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_attention_bandwidth.json"))
    a = p.parse_args(argv)
    dtypes = a.dtypes.split(",")
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown:
        p.error(f"unknown dtypes {unknown}; expected some of {', '.join(DTYPES)}")
    result = measure([int(c) for c in a.contexts.split(",")], dtypes, a.turns, a.steps, not a.no_kernel)
    result["command"] = "python -m benchmarks.cpu.attention_bandwidth " + " ".join(argv if argv is not None else sys.argv[1:])
    a.out.write_text(json.dumps(result, indent=1))
    result["plot"] = plot(result, str(a.out.with_suffix(".png")))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
