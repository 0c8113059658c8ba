"""Baseline 2 on the H200: the same model with its KV cache as in-graph static
buffers of the full capacity, through the same AOTInductor path, side by side
with offgraph-kv in one run.

    python -m benchmarks.cuda.static --layers 16 --out benchmarks/results/cuda_static_h200.json

Both programs come from the same weights (``benchmarks.lib.cuda_model.SHAPE``, bf16):

- **offgraph-kv**: lowered with ``OffGraphKVPartitioner(device="cuda")``, run
  through ExecuTorch (``offgraph_kv.runtime.load_method``);
- **baseline 2, static-mask**: ``benchmarks/lib/static_cache.py`` with capacity
  ``--capacity`` (K/V buffers ``[1, C, H_kv, D]`` written with ``index_copy_``,
  attention over the whole capacity under a causal mask, GQA folded onto the
  query axis so the masked SDPA stays on a fused kernel, cuDNN on the H200,
  instead of the math kernel's repeated K/V), compiled
  by ``torch._inductor.aot_compile`` for CUDA in a fresh process (the same
  -Bsymbolic linker as the backend) and run by torch's AOTI CUDA runner.

The two builds run at the same time (the static one in a child process). Then,
one program at a time: device memory after load and at each context, decode
ms/token at each real context (offgraph-kv's cache is filled by 512-token
prefill chunks; the static cache needs no filling: its cost does not depend on
what the rows hold), prefill tokens/s for a 512-token prompt, and the
attention kernels' own time inside one decode step at the largest context
(CUPTI), as a share of memcpy bandwidth, beside torch's best SDPA kernel timed
alone on the same layout in this run (``benchmarks/cuda/attention.py``).

Targets (printed PASS/FAIL, not asserted): offgraph-kv decode <= 1.05 x
baseline 2 at each context; decode attention inside the step >= torch's best
SDPA share at the largest context.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from benchmarks.lib.cuda_model import MAX_WRITE, SHAPE, SMALL, Runner, build, device_used
from benchmarks.lib.plots import finish_plot, label_axes
from benchmarks.lib.report import save, verdict

# Library attention kernels (flash, cutlass fmha, cuDNN); inductor's own triton
# kernels that carry an SDPA op in their fused name are preparation, not attention.
ATTENTION_KERNEL = re.compile(r"flash|fmha|attention|sdpa", re.IGNORECASE)
MIB = 2**20


def build_static(shape: Dict[str, int], capacity: int, out: Path, device: str) -> Dict[str, object]:
    """Export and AOT-compile baseline 2 (run in a process started with ``symbolic_compile_env``)."""
    from model import ModelArgs, Transformer, example_inputs, init_deterministic

    from benchmarks.lib.static_cache import static_cache_model

    t0 = time.perf_counter()
    model = init_deterministic(Transformer(ModelArgs(**shape)), seed=0).to(torch.bfloat16).eval()
    model = static_cache_model(model, capacity, "mask", fold_gqa=True).to(device)
    example = tuple(t.to(device) for t in example_inputs(4))
    options = {"aot_inductor.package": False, "aot_inductor.check_lowerbound": False}
    if device == "cuda":
        options["aot_inductor.embed_kernel_binary"] = True
    # DYNAMIC, not a named Dim: on CUDA the masked SDPA's strides raise guards
    # such as min(128 T, 512 T) == 128 T that hold for every width but that
    # export cannot prove, and a named Dim turns them into errors.
    t = torch.export.Dim.DYNAMIC(min=1, max=MAX_WRITE)
    with torch.no_grad():
        ep = torch.export.export(model, example, dynamic_shapes={"tokens": {1: t}, "input_pos": {0: t}})
        so = torch._inductor.aot_compile(ep.module(), example, options=options)
    os.replace(so, out)
    return {"path": str(out), "bytes": out.stat().st_size, "build_s": round(time.perf_counter() - t0, 1),
            "capacity": capacity, "attend": "mask (whole capacity), GQA folded"}


def start_static_build(shape: Dict[str, int], capacity: int, out: Path, device: str) -> subprocess.Popen:
    from offgraph_kv.backend.aoti_compile import symbolic_compile_env

    cmd = [sys.executable, "-m", "benchmarks.cuda.static", "--build-static", str(out), "--device", device,
           "--shape", json.dumps(shape), "--capacity", str(capacity)]
    with open(str(out) + ".log", "w") as log:  # the child keeps its own copy of the handle
        return subprocess.Popen(cmd, env=symbolic_compile_env(), stdout=log, stderr=subprocess.STDOUT)


class StaticRunner:
    """Baseline 2 loaded by torch's AOTI runner; host tensors in and out, as the delegate's method."""

    def __init__(self, path: Path, device: str) -> None:
        if device == "cuda":
            self.runner = torch._C._aoti.AOTIModelContainerRunnerCuda(str(path), 1, "cuda")
        else:
            self.runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)
        self.device = device

    def step(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        w = tokens.shape[1]
        pos = torch.arange(start, start + w, dtype=torch.long).unsqueeze(-1)
        return self.runner.run([tokens.to(self.device), pos.to(self.device)])[0].cpu()


def used_since(device: str, before: Optional[int]) -> Optional[int]:
    now = device_used(device)
    return None if now is None or before is None else now - before


def median_ms(step: Callable[[], None], steps: int, skip: Callable[[], bool] = lambda: False) -> float:
    """Median wall ms of ``steps`` calls, leaving out those ``skip`` flags (growth steps)."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        dt = time.perf_counter() - t0
        if not skip():
            times.append(dt)
    return statistics.median(times) * 1e3


def attention_in_step(step: Callable[[], None], steps: int, layers: int, kv_bytes_per_layer: int,
                      memcpy_Bps: float) -> Dict[str, object]:
    """The attention kernels' own GPU time inside ``steps`` decode steps (CUPTI), per layer."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    att = [e for e in kernels if ATTENTION_KERNEL.search(e.name) and not e.name.startswith("triton")]
    att_us = sum(e.time_range.elapsed_us() for e in att) / steps / layers
    busy_us = sum(e.time_range.elapsed_us() for e in kernels) / steps
    return {"kernels": sorted({e.name[:90] for e in att}), "attention_us_per_layer": att_us,
            "attention_share": kv_bytes_per_layer / (att_us / 1e6) / memcpy_Bps if att_us else None,
            "kernels_per_step": len(kernels) / steps, "gpu_busy_ms_per_step": busy_us / 1e3}


def measure_offgraph(pte: Path, device: str, contexts: List[int], steps: int, vocab: int, layers: int,
                     kv_bytes_per_layer_token: int, memcpy_Bps: float) -> Dict[str, object]:
    from tqdm import tqdm

    used0 = device_used(device)
    runner = Runner(pte)
    out: Dict[str, object] = {"device_used_after_load": used_since(device, used0), "contexts": {}}
    gen = torch.Generator().manual_seed(3)
    tok = torch.tensor([[1]], dtype=torch.long)
    for ctx in contexts:
        with tqdm(total=ctx, initial=runner.length, desc=f"fill to {ctx}", unit="tok", mininterval=5) as bar:
            while runner.length < ctx:
                w = min(MAX_WRITE, ctx - runner.length)
                runner.step(torch.randint(0, vocab, (1, w), generator=gen))
                bar.update(w)
        growths = [runner.store.metrics()["growths"]]

        def decode() -> None:
            nonlocal tok
            tok = runner.step(tok)[:, -1:].argmax(-1)

        def grew() -> bool:
            g = runner.store.metrics()["growths"]
            changed, growths[0] = g != growths[0], g
            return changed

        decode()
        row = {"decode_ms": median_ms(decode, steps, grew), "device_used": used_since(device, used0),
               "kv_allocated": runner.store.metrics()["allocated_bytes"]}
        out["contexts"][str(ctx)] = row
        print(f"  offgraph-kv ctx {ctx}: {row['decode_ms']:.3f} ms/token", flush=True)
    top = contexts[-1]
    out["attention_at"] = {"context": top, **attention_in_step(decode, 8, layers, kv_bytes_per_layer_token *
                                                               runner.length, memcpy_Bps)}
    prompt = torch.randint(0, vocab, (1, MAX_WRITE), generator=gen)
    best = float("inf")
    for _ in range(4):
        runner.reset()
        t0 = time.perf_counter()
        runner.step(prompt)
        best = min(best, time.perf_counter() - t0)
    out["prefill_tokens_per_s"] = MAX_WRITE / best
    return out


def measure_static(so: Path, device: str, contexts: List[int], steps: int, vocab: int, layers: int,
                   kv_bytes_per_layer_token: int, capacity: int, memcpy_Bps: float) -> Dict[str, object]:
    used0 = device_used(device)
    t0 = time.perf_counter()
    runner = StaticRunner(so, device)
    out: Dict[str, object] = {"load_s": time.perf_counter() - t0,
                              "device_used_after_load": used_since(device, used0), "contexts": {}}
    gen = torch.Generator().manual_seed(3)
    tok = torch.tensor([[1]], dtype=torch.long)
    for ctx in contexts:
        pos = [ctx]

        def decode() -> None:
            nonlocal tok
            tok = runner.step(tok, pos[0])[:, -1:].argmax(-1)
            pos[0] += 1

        decode()
        row = {"decode_ms": median_ms(decode, steps), "device_used": used_since(device, used0)}
        out["contexts"][str(ctx)] = row
        print(f"  baseline 2 ctx {ctx}: {row['decode_ms']:.3f} ms/token", flush=True)
    # The masked kernel reads the whole capacity whatever the context.
    out["attention_at"] = {"context": contexts[-1], **attention_in_step(decode, 8, layers, kv_bytes_per_layer_token *
                                                                        capacity, memcpy_Bps)}
    prompt = torch.randint(0, vocab, (1, MAX_WRITE), generator=gen)
    runner.step(prompt, 0)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        runner.step(prompt, 0)
        best = min(best, time.perf_counter() - t0)
    out["prefill_tokens_per_s"] = MAX_WRITE / best
    return out


def targets(r: Dict[str, object]) -> List[str]:
    lines = []
    og, st = r.get("offgraph", {}), r.get("static", {})
    for ctx, row in og.get("contexts", {}).items():
        base = st.get("contexts", {}).get(ctx)
        if base:
            ratio = row["decode_ms"] / base["decode_ms"]
            lines.append(f"{verdict(ratio <= 1.05)}  decode at {ctx}: offgraph-kv {row['decode_ms']:.3f} ms vs "
                         f"baseline 2 {base['decode_ms']:.3f} ms = {ratio:.3f} x (<= 1.05)")
    att, best = og.get("attention_at"), r.get("torch_best_sdpa")
    if att and best and att.get("attention_share"):
        lines.append(f"{verdict(att['attention_share'] >= best['share'])}  decode attention inside the step at "
                     f"{att['context']}: {att['attention_us_per_layer']:.1f} us/layer = "
                     f"{100 * att['attention_share']:.0f} % of memcpy bandwidth vs torch's best SDPA alone, "
                     f"{best['backend']}, {100 * best['share']:.0f} %")
    return lines


def run(a: argparse.Namespace) -> Dict[str, object]:
    from benchmarks.cuda.attention import attention_rows, best_share
    from benchmarks.cuda.growth import memcpy_seconds
    from benchmarks.lib.machine import describe

    shape = dict(SMALL if a.small else SHAPE)
    shape["n_layers"] = a.layers or shape["n_layers"]
    shape["attention_head_dim"] = shape.get("attention_head_dim") or shape["dim"] // shape["n_heads"]
    dev = a.device
    contexts = [int(c) for c in a.contexts.split(",")]
    capacity = a.capacity
    if max(contexts) + a.steps + 2 > capacity:
        raise ValueError(f"--capacity {capacity} must hold the largest context {max(contexts)} + {a.steps + 2} steps")
    kv_per_layer_token = 2 * shape["n_kv_heads"] * shape["attention_head_dim"] * 2
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    pte, so = work / "offgraph_cuda.pte", work / f"static_mask_{capacity}.so"
    result: Dict[str, object] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.cuda.static " + " ".join(sys.argv[1:]),
        "machine": describe(), "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": {**shape, "weights_dtype": "bf16", "kv_storage_dtype": "bf16",
                  "kv_bytes_per_token": kv_per_layer_token * shape["n_layers"]},
        "capacity": capacity, "contexts": contexts, "decode_steps": a.steps,
    }
    print(f"building {so.name} (child process) and {pte.name} ...", flush=True)
    child = start_static_build(shape, capacity, so, dev)
    result["offgraph_build"] = build(shape, dev, capacity, pte)
    print(f"  offgraph-kv: {result['offgraph_build']}", flush=True)
    rc = child.wait()
    if rc != 0 or not so.is_file():
        result["static_build"] = {"error": f"rc {rc}", "log_tail": Path(str(so) + ".log").read_text()[-3000:]}
    else:
        result["static_build"] = json.loads(Path(str(so) + ".build.json").read_text())
    print(f"  baseline 2: {result['static_build']}", flush=True)
    save(result, a.out)

    mc = 1 << 30
    memcpy_Bps = 2 * mc / memcpy_seconds(mc) if dev == "cuda" else float("nan")
    result["memcpy_TBps"] = memcpy_Bps / 1e12
    result["offgraph"] = measure_offgraph(pte, dev, contexts, a.steps, shape["vocab_size"], shape["n_layers"],
                                          kv_per_layer_token, memcpy_Bps)
    save(result, a.out)
    if "error" not in result["static_build"]:
        result["static"] = measure_static(so, dev, contexts, a.steps, shape["vocab_size"], shape["n_layers"],
                                          kv_per_layer_token, capacity, memcpy_Bps)
        save(result, a.out)
    top = contexts[-1]
    if dev != "cuda":
        result["targets"] = targets(result)
        return result
    rows = attention_rows([top], memcpy_Bps, shape={"n_heads": shape["n_heads"], "n_kv_heads": shape["n_kv_heads"],
                                                    "head_dim": shape["attention_head_dim"]})
    best = best_share(rows, top)
    result["attention_kernels"] = rows
    if best:
        result["torch_best_sdpa"] = {"backend": f"{best['backend']} ({best['form']})", "share": best["growing_share"],
                                     "ms": best["growing_ms"], "context": top}
    result["targets"] = targets(result)
    return result


def plot(result: Dict[str, object], path: Path) -> str:
    """Decode ms/token and device memory vs context, offgraph-kv beside baseline 2 (one PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = result["model"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    series = (("offgraph", "offgraph-kv", "o-"), ("static", "baseline 2: static KV, same AOTI path", "s--"))
    for key, label, style in series:
        rows = result.get(key, {}).get("contexts", {})
        ctxs = sorted(int(c) for c in rows)
        if not ctxs:
            continue
        left.plot(ctxs, [rows[str(c)]["decode_ms"] for c in ctxs], style, label=label)
        used = [rows[str(c)]["device_used"] for c in ctxs]
        if all(u is not None for u in used):
            right.plot(ctxs, [u / MIB for u in used], style, label=label)
    sub = (f"{result['device']}, {result['date'][:10]}; {m['n_layers']} layers, {m['n_kv_heads']} KV heads x "
           f"{m['attention_head_dim']}, bf16, capacity {result['capacity']}")
    label_axes(left, "context (tokens in the cache)", "decode ms/token", f"Decode\n{sub}")
    return finish_plot(fig, right, "context (tokens in the cache)", "device memory used since before load (MiB)",
                   f"Memory\n{sub}", str(path))


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--small", action="store_true", help="a 2-layer toy (dry run of the script on CPU)")
    p.add_argument("--layers", type=int, help=f"layer count (default {SHAPE['n_layers']})")
    p.add_argument("--capacity", type=int, default=32768, help="baseline 2's static capacity (and offgraph-kv's max)")
    p.add_argument("--contexts", default="1024,8192,32000")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per context")
    p.add_argument("--workdir", default="/tmp/offgraph_cuda_static")
    p.add_argument("--out")
    p.add_argument("--plot", help="only draw the PNG of an existing result JSON")
    p.add_argument("--build-static", help=argparse.SUPPRESS)  # the child process: build baseline 2 there
    p.add_argument("--shape", help=argparse.SUPPRESS)  # the model shape, JSON, for the child
    a = p.parse_args(argv)
    if a.build_static:
        info = build_static(json.loads(a.shape), a.capacity, Path(a.build_static), a.device)
        Path(a.build_static + ".build.json").write_text(json.dumps(info, indent=2))
        return 0
    if a.plot:
        print(plot(json.loads(Path(a.plot).read_text()), Path(a.plot).with_suffix(".png")))
        return 0
    os.environ.setdefault("AOTI_RUNTIME_CHECK_INPUTS", "0")
    result = run(a)
    print("\n".join(result["targets"]))
    save(result, a.out)
    if a.out:
        print(plot(result, Path(a.out).with_suffix(".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
