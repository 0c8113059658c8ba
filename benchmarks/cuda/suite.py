"""The H200 suite: offgraph-kv on CUDA, everything compared in one run.

    python -m benchmarks.cuda --workdir /tmp/cuda_bench --out benchmarks/results/cuda_h200.json
    python -m benchmarks.cuda --plot benchmarks/results/cuda_h200.json   # PNGs from a result (any machine)

Model: a 32-layer decoder with Llama-3-8B attention shapes (32 query heads,
8 KV heads, head dim 128) on a narrow residual stream (dim 512), bf16 weights
and bf16 KV, random weights: 128 KiB of KV per token, so at 32K context a
decode step reads 4 GiB of KV against 0.4 GB of weights. Lowered with
``device="cuda"``; loaded with ``offgraph_kv.runtime.load_method`` (the C++ Module under the image's torch).

Measured in the same run:

- one greedy generation from an empty cache (initial capacity 256, doubling)
  to 32 000 tokens: per-step wall time, growth steps and their extra time,
  device memory at 200 / 2 000 / 8 000 / 32 000 tokens;
- decode ms/token at 1K / 8K / 32K real context (median of steps around it);
- host work per step (the delegate's own counter: width, prepare, bind,
  commit; kernels and the output copy excluded);
- prefill tokens/s for a 512-token prompt;
- the same decode at 1K context with the whole 32K capacity allocated up front
  (capacity must not cost speed);
- torch's SDPA kernels on one layer's KV in the store's layout at each context
  (benchmarks/cuda/attention.py), and attention time per layer derived from
  our decode times, both as a share of memcpy bandwidth;
- growth copy (one allocation + one copy-kernel launch; also the driver's
  batched and per-tensor copies) vs plain memcpy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from benchmarks.cuda.attention import attention_rows
from benchmarks.cuda.growth import COPY_MODES, growth_rows, memcpy_seconds
from benchmarks.lib.cuda_model import INITIAL_CAPACITY, MAX_WRITE, MIB, SHAPE, SMALL, Runner, build, device_used
from benchmarks.lib.plots import finish_plot
from benchmarks.lib.report import rolling, save, verdict
from benchmarks.lib.step_times import growth_share


def generate(runner: Runner, n: int, device: str, marks: List[int]) -> Dict[str, object]:
    from tqdm import tqdm

    times: List[float] = []
    grew: List[bool] = []
    memory: Dict[str, object] = {}
    tok = torch.tensor([[1]], dtype=torch.long)
    growths = runner.store.metrics()["growths"]
    for i in tqdm(range(n), desc="generate", unit="tok", mininterval=5):
        t0 = time.perf_counter()
        logits = runner.step(tok)
        times.append(time.perf_counter() - t0)
        tok = logits[:, -1:].argmax(-1)
        g = runner.store.metrics()["growths"]
        grew.append(g != growths)
        growths = g
        if i + 1 in marks:
            m = runner.store.metrics()
            memory[str(i + 1)] = {"device_used": device_used(device), "kv_allocated": m["allocated_bytes"],
                                  "kv_peak": m["peak_bytes"], "capacity": m["capacity"]}
    return {"step_s": times, "grew": grew, "memory": memory}


def decode_at(times: List[float], grew: List[bool], ctx: int, half: int = 16) -> Optional[float]:
    """Median ms of the non-growth steps whose context is within ``half`` of ``ctx``."""
    near = [times[i] for i in range(max(0, ctx - half), min(len(times), ctx + half)) if not grew[i]]
    return statistics.median(near) * 1e3 if near else None


def host_us(runner: Runner, fn) -> float:  # noqa: ANN001
    """Delegate host work per step over the steps ``fn`` runs."""
    before = runner.store.metrics()
    fn()
    after = runner.store.metrics()
    steps = after["steps"] - before["steps"]
    total = after["host_us_per_step"] * after["steps"] - before["host_us_per_step"] * before["steps"]
    return total / steps if steps else float("nan")


def prefill(runner: Runner, vocab: int, repeats: int = 3) -> Dict[str, float]:
    prompt = torch.randint(0, vocab, (1, MAX_WRITE), generator=torch.Generator().manual_seed(7))
    runner.reset()
    runner.step(prompt)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        runner.reset()
        t0 = time.perf_counter()
        runner.step(prompt)
        best = min(best, time.perf_counter() - t0)
    runner.reset()
    return {"tokens": MAX_WRITE, "seconds": best, "tokens_per_s": MAX_WRITE / best}


def attention_shares(decode_ms: Dict[str, Optional[float]], kernels: List[Dict[str, object]], layers: int,
                     kv_bytes_per_layer_token: int, memcpy_Bps: float) -> List[Dict[str, object]]:
    """Attention time per layer that context adds, from our decode times (subtracting the smallest
    context removes weights, launches and host work, which do not depend on context), as a share of
    memcpy bandwidth over the KV bytes it adds; beside it torch's fastest SDPA kernel timed alone on
    the same layout (context growing every call, as in decode), as a share over the whole history."""
    ctxs = sorted(int(c) for c, v in decode_ms.items() if v is not None)
    if len(ctxs) < 2:
        return []
    lo = ctxs[0]
    out = []
    for ctx in ctxs[1:]:
        extra_bytes = (ctx - lo) * kv_bytes_per_layer_token
        ours_s = (decode_ms[str(ctx)] - decode_ms[str(lo)]) / 1e3 / layers
        row: Dict[str, object] = {"context": ctx, "from_context": lo, "ours_ms_per_layer": ours_s * 1e3,
                                  "ours_share": extra_bytes / ours_s / memcpy_Bps if ours_s > 0 else None}
        # torch's kernels on their own: the whole history's bytes over the kernel's time at this context.
        ok = [k for k in kernels if k["context"] == ctx and "growing_share" in k]
        top = max(ok, key=lambda k: k["growing_share"]) if ok else None
        best = (f"{top['backend']} ({top['form']})", top["growing_share"], top["growing_ms"]) if top else None
        if best:
            row.update(torch_best=best[0], torch_best_share=best[1], torch_best_ms=best[2])
        out.append(row)
    return out


def model_shape(small: bool, layers: Optional[int]) -> Dict[str, int]:
    """The suite's model (or the --small toy), with ``layers`` layers where given."""
    shape = dict(SMALL if small else SHAPE)
    if layers:
        shape["n_layers"] = layers
    return {**shape, "attention_head_dim": shape.get("attention_head_dim") or shape["dim"] // shape["n_heads"]}


def measure_generation(result: Dict[str, object], pte: Path, device: str, n: int, contexts: List[int],
                       vocab: int) -> None:
    """Load, generate ``n`` tokens from an empty cache, then prefill: into ``result``'s memory_after_load,
    generation and prefill."""
    marks = [m for m in (200, 2000, 8000, 32000) if m <= n]
    used0 = device_used(device)
    runner = Runner(pte)
    result["memory_after_load"] = {"device_used_delta": None if used0 is None else device_used(device) - used0,
                                   "kv_allocated": runner.store.metrics()["allocated_bytes"]}
    gen: Dict[str, object] = {}

    def generation() -> None:
        gen.update(generate(runner, n, device, marks))

    gen_host_us = host_us(runner, generation)
    times, grew = gen["step_s"], gen["grew"]
    for m in gen["memory"].values():
        if used0 is not None and m["device_used"] is not None:
            m["device_used_delta"] = m["device_used"] - used0
    decode = {str(c): decode_at(times, grew, c) for c in contexts}
    result["generation"] = {
        "tokens": n, "decode_ms": decode, "memory": gen["memory"], "host_us_per_step": gen_host_us,
        "final": runner.store.metrics() | {"layers": None},
        "growth": growth_share(times, grew), "step_ms_rolling": rolling([t * 1e3 for t in times]),
    }
    result["prefill"] = prefill(runner, vocab)


def measure_preallocated(pte: Path, context: int, max_capacity: int, grown_ms: Optional[float]) -> Dict[str, object]:
    """Capacity must not cost speed: the same decode at ``context`` with all of it allocated up front.
    Call it with no other Runner of ``pte`` alive (their stores would share the device)."""
    import offgraph_kv.runtime as rt

    rt.configure(initial_capacity=max_capacity)
    try:
        full = Runner(pte)
    finally:
        rt.configure()
    tok = torch.tensor([[1]], dtype=torch.long)
    full_times = []
    for i in range(context + 16):
        t0 = time.perf_counter()
        tok = full.step(tok)[:, -1:].argmax(-1)
        full_times.append(time.perf_counter() - t0)
    full_ms = decode_at(full_times, [False] * len(full_times), context)
    return {"context": context, "grown_ms": grown_ms, "preallocated_ms": full_ms,
            "preallocated_capacity": full.store.capacity, "ratio": full_ms / grown_ms if grown_ms else None}


def measure_kernels(contexts: List[int], shape: Dict[str, int], decode: Dict[str, Optional[float]],
                    kv_per_layer_token: int) -> Dict[str, object]:
    """CUDA only: memcpy bandwidth, torch's SDPA kernels and the attention share of our decode, growth copies."""
    mc_bytes = 1 << 30
    memcpy_Bps = 2 * mc_bytes / memcpy_seconds(mc_bytes)
    out: Dict[str, object] = {"memcpy_TBps": memcpy_Bps / 1e12}
    out["attention_kernels"] = attention_rows(
        contexts, memcpy_Bps, shape={"n_heads": shape["n_heads"], "n_kv_heads": shape["n_kv_heads"],
                                     "head_dim": shape["attention_head_dim"]})
    out["attention"] = attention_shares(decode, out["attention_kernels"], shape["n_layers"], kv_per_layer_token,
                                        memcpy_Bps)
    out["growth_copy"] = {mode: growth_rows(mode) for mode in COPY_MODES}
    return out


def run(args: argparse.Namespace) -> Dict[str, object]:
    """Build the program, then measure it step by step, saving ``result`` after each step."""
    from benchmarks.lib.machine import describe

    shape = model_shape(args.small, args.layers)
    contexts = [int(c) for c in args.contexts.split(",")]
    n = max(contexts) + 16
    max_capacity = 1 << (n - 1).bit_length()
    kv_per_layer_token = 2 * shape["n_kv_heads"] * shape["attention_head_dim"] * 2
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    pte = workdir / f"offgraph_{args.device}.pte"
    result: Dict[str, object] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.cuda " + " ".join(sys.argv[1:]),
        "machine": describe(), "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "model": {**shape, "weights_dtype": "bf16", "kv_storage_dtype": "bf16",
                  "kv_bytes_per_token": kv_per_layer_token * shape["n_layers"]},
        "max_capacity": max_capacity, "initial_capacity": INITIAL_CAPACITY,
    }
    print(f"building {pte.name} ...", flush=True)
    result["build"] = build(shape, args.device, max_capacity, pte)
    print(f"  {result['build']}", flush=True)
    save(result, args.out)

    measure_generation(result, pte, args.device, n, contexts, shape["vocab_size"])
    save(result, args.out)
    lo = min(contexts)
    decode = result["generation"]["decode_ms"]
    result["capacity_independence"] = measure_preallocated(pte, lo, max_capacity, decode[str(lo)])
    save(result, args.out)

    if args.device == "cuda":
        result.update(measure_kernels(contexts, shape, decode, kv_per_layer_token))
    result["targets"] = targets(result)
    return result


def targets(r: Dict[str, object]) -> List[str]:
    g = r["generation"]
    lines = []
    hu = g["host_us_per_step"]
    lines.append(f"{verdict(hu < 20)}  host work per step {hu:.1f} us ({r['model']['n_layers']} layers) < 20 us")
    share = g["growth"]["growth_time_share"]
    lines.append(f"{verdict(None if share is None else share <= 0.01)}  growth {100 * (share or 0):.3f} % of "
                 f"{g['tokens']}-token generation time <= 1 %")
    ci = r["capacity_independence"]
    if ci["ratio"] is not None:
        lines.append(f"{verdict(ci['ratio'] <= 1.05)}  decode at {ci['context']} with capacity "
                     f"{ci['preallocated_capacity']} preallocated: {ci['ratio']:.3f} x the grown store (<= 1.05)")
    bpt = r["model"]["kv_bytes_per_token"]
    for tokens, m in g["memory"].items():
        bound = 2 * bpt * int(tokens) + bpt * INITIAL_CAPACITY
        lines.append(f"{verdict(m['kv_allocated'] <= bound)}  KV allocated after {tokens} tokens "
                     f"{m['kv_allocated'] / MIB:.1f} MiB <= 2 x bytes/token x length + initial "
                     f"({bound / MIB:.1f} MiB)")
    for row in r.get("attention", []):
        best = row.get("torch_best_share")
        if row["context"] < 32000 or best is None:
            continue
        if row["ours_share"] is None:  # decode got no slower with context: kernels hide behind launches
            lines.append(f"n/a   decode attention at {row['context']}: decode time does not grow with context "
                         f"({row['ours_ms_per_layer'] * 1e3:+.1f} us/layer from {row['from_context']}), so no "
                         f"attention share can be derived; torch's best, {row['torch_best']}, "
                         f"{100 * best:.0f} %")
        else:
            lines.append(f"{verdict(row['ours_share'] >= best)}  decode attention at {row['context']}: "
                         f"{100 * row['ours_share']:.0f} % of memcpy bandwidth vs torch's best SDPA, "
                         f"{row['torch_best']}, {100 * best:.0f} %")
    for row in r.get("growth_copy", {}).get("kernel", []):
        lines.append(f"{verdict(row['ratio'] >= 0.9)}  growth copy {row['bytes_copied'] / MIB:.0f} MiB: "
                     f"{row['ratio']:.2f} of one memcpy's bandwidth (>= 0.90); {row['ratio_vs_back_to_back']:.2f} of "
                     f"back-to-back memcpy; whole growth with fresh memory {row['growth_ratio']:.2f}")
    return lines


def plot(result: Dict[str, object], stem: Path) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = result["generation"]
    m = result["model"]
    sub = (f"{result['device']}, {result['date'][:10]}; {m['n_layers']} layers, {m['n_kv_heads']} KV heads x "
           f"{m['attention_head_dim']}, bf16")
    fig, ax = plt.subplots(figsize=(9, 5))
    xs, ys = zip(*g["step_ms_rolling"])
    ax.plot(xs, ys, color="tab:blue", label="offgraph-kv decode (median of 32 steps)")
    decode_png = finish_plot(fig, ax, "context (tokens already in the cache)", "ms/token",
                             f"Decode time vs context\n{sub}", f"{stem}_decode.png")

    fig, ax = plt.subplots(figsize=(9, 5))
    toks = sorted(int(t) for t in g["memory"])
    bpt = m["kv_bytes_per_token"]
    ax.plot(toks, [g["memory"][str(t)]["kv_allocated"] / MIB for t in toks], "o-", label="KV allocated")
    dev = [g["memory"][str(t)].get("device_used_delta") for t in toks]
    if all(d is not None for d in dev):
        ax.plot(toks, [d / MIB for d in dev], "s-", label="device memory used since before load")
    ax.plot([0, toks[-1]], [0, bpt * toks[-1] / MIB], "k:", label="bytes/token x length")
    memory_png = finish_plot(fig, ax, "generated tokens", "MiB", f"Memory vs generated tokens\n{sub}",
                             f"{stem}_memory.png")
    return [decode_png, memory_png]


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cuda", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--small", action="store_true", help="a 2-layer toy (dry run of the script on CPU)")
    p.add_argument("--contexts", default="1024,8192,32000")
    p.add_argument("--layers", type=int, help="override the layer count (compile time grows with it)")
    p.add_argument("--workdir", default="/tmp/offgraph_cuda_bench")
    p.add_argument("--out")
    p.add_argument("--plot", help="only draw the PNGs of an existing result JSON")
    a = p.parse_args(argv)
    if a.plot:
        print("\n".join(plot(json.loads(Path(a.plot).read_text()), Path(a.plot).with_suffix(""))))
        return 0
    os.environ.setdefault("AOTI_RUNTIME_CHECK_INPUTS", "0")
    result = run(a)
    print("\n".join(result["targets"]))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
