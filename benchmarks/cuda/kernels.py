"""Our Triton update-and-attend kernels beside today's torch path, in one run (H200).

    python -m benchmarks.cuda.kernels --layers 16 --out benchmarks/results/cuda_kernels_h200.json

Two parts:

1. Kernels alone (no AOTI), one layer of Llama-3-8B attention shape (32 q / 8 kv
   heads x 128, bf16) over storage ``[1, capacity, 8, 128]``: our decode step
   (write + attend, length from a device tensor) at 1K / 8K / 32K / 128K context,
   a ring layer (window 4,096) and a 512-token prefill chunk, each timed by
   CUDA-graph replay (GPU time, no launch overhead), as a share of device
   memcpy bandwidth over the K/V bytes read; beside them torch's cuDNN and
   flash SDPA on the same data, timed the same way.
2. Whole decode step: the 16-layer model of ``benchmarks/cuda/suite.py`` (dim 512,
   Llama-3-8B attention shapes, bf16, random weights) lowered twice, once with
   today's torch attention (``OFFGRAPH_KV_CUDA_ATTENTION=torch`` at export) and
   once with our kernels, loaded side by side; decode ms/token at 1K / 8K /
   32K (medians, the two programs alternating) and kernels per step from the
   profiler.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

MIB = 2**20


def decode_case(ctx: int, hq: int, hkv: int, d: int) -> "tuple":
    """One bf16 decode step's operands over ``ctx`` stored rows (the store has
    room for the step's own row): q, k, v, k_store, v_store, length, KV bytes read."""
    bf = torch.bfloat16
    ks = torch.randn(1, ctx + 1, hkv, d, device="cuda", dtype=bf)
    vs = torch.randn_like(ks)
    q = torch.randn(1, hq, 1, d, device="cuda", dtype=bf)
    k = torch.randn(1, hkv, 1, d, device="cuda", dtype=bf)
    v = torch.randn_like(k)
    length = torch.tensor([ctx], device="cuda")
    return q, k, v, ks, vs, length, 2 * (ctx + 1) * hkv * d * 2


def graph_time(fn: Callable[[], object], reps: int = 20) -> float:
    """Seconds per call of ``fn`` as the GPU runs it: ``reps`` calls captured in one
    CUDA graph, the replay timed with events (no launch overhead in the number)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3 / reps)
    return best


def kernel_rows(memcpy_Bps: float, contexts: List[int]) -> Dict[str, object]:
    from offgraph_kv.backend.triton_attention import update_attend

    hq, hkv, d = 32, 8, 128
    bf = torch.bfloat16
    dev = "cuda"
    scale = d ** -0.5
    out: Dict[str, object] = {"decode": [], "ring": [], "prefill": []}
    for ctx in contexts:
        q, k, v, ks, vs, length, kv_bytes = decode_case(ctx, hq, hkv, d)
        ours = graph_time(lambda: update_attend(q, k, v, ks, vs, length, 0, scale, bf))
        keys, values = ks.transpose(1, 2), vs.transpose(1, 2)
        row = {"context": ctx, "kv_bytes": kv_bytes, "ours_ms": ours * 1e3, "ours_share": kv_bytes / ours / memcpy_Bps}
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
            try:
                with sdpa_kernel([getattr(SDPBackend, name)]):
                    t = graph_time(lambda: torch.nn.functional.scaled_dot_product_attention(
                        q, keys, values, enable_gqa=True, scale=scale))
                row[f"{name}_ms"] = t * 1e3
                row[f"{name}_share"] = kv_bytes / t / memcpy_Bps
            except RuntimeError as e:
                row[f"{name}_error"] = str(e).splitlines()[0][:120]
        out["decode"].append(row)
        print(json.dumps(row), flush=True)
        del ks, vs

    window, max_write = 4096, 512
    slots = window + max_write - 1
    ks = torch.randn(1, slots, hkv, d, device=dev, dtype=bf)
    vs = torch.randn_like(ks)
    q = torch.randn(1, hq, 1, d, device=dev, dtype=bf)
    k = torch.randn(1, hkv, 1, d, device=dev, dtype=bf)
    v = torch.randn_like(k)
    length = torch.tensor([100_003], device=dev)  # well past many wraps
    t = graph_time(lambda: update_attend(q, k, v, ks, vs, length, window, scale, bf))
    kv_bytes = 2 * window * hkv * d * 2
    row = {"window": window, "slots": slots, "ours_ms": t * 1e3, "ours_share": kv_bytes / t / memcpy_Bps}
    out["ring"].append(row)
    print(json.dumps(row), flush=True)

    for ctx in (0, 4096):
        tw = 512
        ks = torch.randn(1, ctx + tw, hkv, d, device=dev, dtype=bf)
        vs = torch.randn_like(ks)
        q = torch.randn(1, hq, tw, d, device=dev, dtype=bf)
        k = torch.randn(1, hkv, tw, d, device=dev, dtype=bf)
        v = torch.randn_like(k)
        length = torch.tensor([ctx], device=dev)
        ours = graph_time(lambda: update_attend(q, k, v, ks, vs, length, 0, scale, bf), reps=5)
        keys, values = ks.transpose(1, 2), vs.transpose(1, 2)
        flash = graph_time(lambda: torch.ops.aten._scaled_dot_product_flash_attention(
            q, keys, values, is_causal=True, scale=scale), reps=5)
        # Causal work: query i sees ctx + i + 1 keys.
        flops = 4 * hq * d * sum(ctx + i + 1 for i in range(tw))
        row = {"context": ctx, "width": tw, "ours_ms": ours * 1e3, "flash_ms": flash * 1e3,
               "ours_TFLOPs": flops / ours / 1e12, "flash_TFLOPs": flops / flash / 1e12}
        out["prefill"].append(row)
        print(json.dumps(row), flush=True)
    return out


def tuning_sweep(memcpy_Bps: float, contexts: List[int]) -> List[Dict[str, object]]:
    """Decode kernel variants (keys per block, warps, programs per SM), eager, to choose the defaults."""
    from offgraph_kv.backend import triton_attention as ta

    hq, hkv, d = 32, 8, 128
    bf = torch.bfloat16
    defaults = (ta.BLOCK_N, ta.NUM_WARPS, ta.PROGRAMS_PER_SM, ta.NUM_STAGES)
    rows = []
    try:
        for ctx in contexts:
            q, k, v, ks, vs, length, kv_bytes = decode_case(ctx, hq, hkv, d)
            for bn in (64, 128):
                for warps in (4, 8):
                    for pps in (2, 4):
                        for stages in (2, 3, 4):
                            ta.BLOCK_N, ta.NUM_WARPS, ta.PROGRAMS_PER_SM, ta.NUM_STAGES = bn, warps, pps, stages
                            t = graph_time(lambda: ta.update_attend(q, k, v, ks, vs, length, 0, d ** -0.5, bf))
                            rows.append({"context": ctx, "block_n": bn, "warps": warps, "programs_per_sm": pps,
                                         "stages": stages, "ms": t * 1e3, "share": kv_bytes / t / memcpy_Bps})
            best = max((r for r in rows if r["context"] == ctx), key=lambda r: r["share"])
            print(f"sweep ctx {ctx}: best {json.dumps(best)}", flush=True)
            del ks, vs
    finally:
        ta.BLOCK_N, ta.NUM_WARPS, ta.PROGRAMS_PER_SM, ta.NUM_STAGES = defaults
    return rows


def prefill_sweep(contexts: List[int]) -> List[Dict[str, object]]:
    """Wide-step (prefill chunk) kernel variants, eager: rows and keys per block, warps, stages."""
    from offgraph_kv.backend import triton_attention as ta

    hq, hkv, d, tw = 32, 8, 128, 512
    bf = torch.bfloat16
    defaults = (ta.WIDE_BLOCK_M, ta.WIDE_BLOCK_N, ta.WIDE_NUM_WARPS, ta.NUM_STAGES)
    rows = []
    try:
        for ctx in contexts:
            ks = torch.randn(1, ctx + tw, hkv, d, device="cuda", dtype=bf)
            vs = torch.randn_like(ks)
            q = torch.randn(1, hq, tw, d, device="cuda", dtype=bf)
            k = torch.randn(1, hkv, tw, d, device="cuda", dtype=bf)
            v = torch.randn_like(k)
            length = torch.tensor([ctx], device="cuda")
            flops = 4 * hq * d * sum(ctx + i + 1 for i in range(tw))
            for bm, bn, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
                ta.WIDE_BLOCK_M, ta.WIDE_BLOCK_N, ta.WIDE_NUM_WARPS, ta.NUM_STAGES = bm, bn, warps, stages
                try:
                    t = graph_time(lambda: ta.update_attend(q, k, v, ks, vs, length, 0, d ** -0.5, bf), reps=5)
                except Exception as e:  # a variant out of shared memory or registers
                    rows.append({"context": ctx, "block_m": bm, "block_n": bn, "warps": warps, "stages": stages,
                                 "error": str(e).splitlines()[0][:160]})
                    continue
                rows.append({"context": ctx, "block_m": bm, "block_n": bn, "warps": warps, "stages": stages,
                             "ms": t * 1e3, "TFLOPs": flops / t / 1e12})
            best = max((r for r in rows if r["context"] == ctx and "ms" in r), key=lambda r: r["TFLOPs"])
            print(f"prefill sweep ctx {ctx}: best {json.dumps(best)}", flush=True)
            del ks, vs
    finally:
        ta.WIDE_BLOCK_M, ta.WIDE_BLOCK_N, ta.WIDE_NUM_WARPS, ta.NUM_STAGES = defaults
    return rows


def _build(shape: Dict[str, int], capacity: int, out: Path) -> Dict[str, object]:
    from benchmarks.lib.cuda_model import build

    return build(shape, "cuda", capacity, out)


def step_profile(step: Callable[[], None], steps: int, layers: int) -> Dict[str, object]:
    """Kernels per decode step and our / torch's attention kernels' GPU time per layer (CUPTI)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    att = [e for e in kernels if any(s in e.name.lower() for s in ("update_attend", "_combine", "flash", "fmha",
                                                                      "attention", "sdpa"))
           and not e.name.startswith("triton_")]
    return {"kernels_per_step": len(kernels) / steps,
            "kernels_per_layer": len(kernels) / steps / layers,
            "attention_us_per_layer": sum(e.time_range.elapsed_us() for e in att) / steps / layers,
            "gpu_busy_ms_per_step": sum(e.time_range.elapsed_us() for e in kernels) / steps / 1e3,
            "attention_kernels": sorted({e.name[:80] for e in att})}


def decode_side_by_side(ptes: Dict[str, Path], contexts: List[int], steps: int, vocab: int,
                        layers: int) -> Dict[str, object]:
    from benchmarks.lib.cuda_model import MAX_WRITE, Runner

    runners = {name: Runner(p) for name, p in ptes.items()}
    toks = {name: torch.tensor([[1]], dtype=torch.long) for name in ptes}
    out: Dict[str, object] = {name: {} for name in ptes}
    for ctx in contexts:
        for name, r in runners.items():
            g = torch.Generator().manual_seed(ctx)
            while r.length < ctx:
                w = min(MAX_WRITE, ctx - r.length)
                r.step(torch.randint(0, vocab, (1, w), generator=g))
        times: Dict[str, List[float]] = {name: [] for name in ptes}

        def one(name: str) -> None:
            toks[name] = runners[name].step(toks[name])[:, -1:].argmax(-1)

        for name in ptes:
            one(name)  # warm-up (and any growth) outside the timing
        for _ in range(steps):
            for name in ptes:
                grew0 = runners[name].store.metrics()["growths"]
                t0 = time.perf_counter()
                one(name)
                dt = time.perf_counter() - t0
                if runners[name].store.metrics()["growths"] == grew0:
                    times[name].append(dt)
        for name in ptes:
            row = {"decode_ms": statistics.median(times[name]) * 1e3, "steps": len(times[name]),
                   **step_profile(lambda n=name: one(n), 4, layers)}
            out[name][str(ctx)] = row
            print(f"  {name} ctx {ctx}: {row['decode_ms']:.3f} ms/token, {row['kernels_per_layer']:.1f} kernels/layer,"
                  f" attention {row['attention_us_per_layer']:.1f} us/layer", flush=True)
    return out


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--contexts", default="1024,8192,32000")
    p.add_argument("--kernel-contexts", default="1024,8192,32768,131072")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--workdir", default="/tmp/cuda_kernels")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--sweep", action="store_true", help="also time decode kernel variants (eager)")
    p.add_argument("--prefill-sweep", action="store_true", help="also time wide-step kernel variants (eager)")
    p.add_argument("--build-only", help="(child) build one program to this path and exit")
    p.add_argument("--out", required=False)
    a = p.parse_args(argv)
    os.environ.setdefault("AOTI_RUNTIME_CHECK_INPUTS", "0")
    from benchmarks.lib.cuda_model import SHAPE

    shape = dict(SHAPE, n_layers=a.layers)
    capacity = 1 << 15
    if a.build_only:
        print(json.dumps(_build(shape, capacity, Path(a.build_only))))
        return 0

    from benchmarks.cuda.growth import memcpy_seconds

    result: Dict[str, object] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.cuda.kernels " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
    }
    import triton

    result["triton"] = triton.__version__

    def save() -> None:
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=2))

    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    ptes = {"torch": work / "torch_path.pte", "triton": work / "triton_path.pte"}
    child = None
    if not a.skip_decode:
        # Both programs compile at once (16 cores): today's path in a child with the switch set.
        env = dict(os.environ, OFFGRAPH_KV_CUDA_ATTENTION="torch")
        cmd = [sys.executable, "-m", "benchmarks.cuda.kernels", "--layers", str(a.layers),
               "--build-only", str(ptes["torch"])]
        child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        t0 = time.perf_counter()
        os.environ["OFFGRAPH_KV_CUDA_ATTENTION"] = "triton"  # the default, said explicitly (triton_attention.ENV_SWITCH)
        try:
            result["build_triton"] = _build(shape, capacity, ptes["triton"])
            print(f"built triton path: {result['build_triton']}", flush=True)
        except RuntimeError as e:  # the kernels-alone numbers below still count
            result["build_triton"] = {"error": str(e)[-3000:]}
            ptes.pop("triton")
            print(f"triton path build failed: {str(e)[-1500:]}", flush=True)

    mc = 1 << 30
    memcpy_Bps = 2 * mc / memcpy_seconds(mc)
    result["memcpy_TBps"] = memcpy_Bps / 1e12
    result["kernels"] = kernel_rows(memcpy_Bps, [int(c) for c in a.kernel_contexts.split(",")])
    save()
    if child is not None:
        log = child.communicate()[0]
        result["build_torch"] = {"rc": child.returncode, "log_tail": log[-2000:]}
        print(f"built torch path: rc {child.returncode} after {time.perf_counter() - t0:.0f} s", flush=True)
        if child.returncode != 0:
            print(log[-3000:])
            ptes.pop("torch")
    if child is not None and ptes:
        result["model"] = {**shape, "kv_storage_dtype": "bf16", "capacity": capacity}
        result["decode"] = decode_side_by_side(ptes, [int(c) for c in a.contexts.split(",")], a.steps,
                                               shape["vocab_size"], a.layers)
        save()
    if a.sweep:  # last: the least needed part of a run that may be cut short
        result["sweep"] = tuning_sweep(memcpy_Bps, [8192, 32768, 131072])
        save()
    if a.prefill_sweep:
        result["prefill_sweep"] = prefill_sweep([0, 4096])
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
