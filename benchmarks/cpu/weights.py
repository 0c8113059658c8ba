"""Weights outside the compiled code, measured: load time and memory right after load vs weight bytes.

Side by side in one run, for random-weight Llama shapes (bf16 weights):

- ``in-code``: the same code with the weights compiled into the AOTI shared
  object (``OFFGRAPH_KV_WEIGHTS_IN_CODE=1``, manifest version 2: what main did
  before), when the shape allows it (~2 GB of weights is the limit);
- ``outside``: weights as named data of the .pte, mapped at load (this code).

Every export and every measurement runs in its own process. Before each load
the .pte's pages are dropped from the page cache (``posix_fadvise DONTNEED``
on that one file), so "load + first step" includes reading the file; reading
the file cold with plain ``read`` is timed as the floor.

    python -m benchmarks.cpu.weights --shapes small,1b --out benchmarks/results/weights_cpu.json
    python -m benchmarks.cpu.weights --device cuda --shapes 1b --variants outside   # on the H200
    python -m benchmarks.cpu.weights --device cuda --shapes 8b --variants outside \
        --contexts 1024,8192,32768 --out benchmarks/results/weights_cuda_8b_h200.json  # decode vs context
    python -m benchmarks.cpu.weights --plot OUT.png RESULT.json...                  # memory after load / weights
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

from benchmarks.lib.machine import drop_from_page_cache
from benchmarks.lib.paths import REPO, RESULTS, use_example_model

use_example_model()

SHAPES: Dict[str, Dict[str, object]] = {
    # ~370 MB of bf16 weights: exports in about a minute on 2 cores, either way.
    "small": dict(dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, vocab_size=32000, hidden_dim=4096),
    # Llama-3.2-1B shape, untied output: 1.50 B parameters, 3.0 GB in bf16.
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, hidden_dim=8192,
               rope_theta=500000.0),
    # Llama-3-8B shape: 8.0 B parameters, 16 GB in bf16 (the H200 only).
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, hidden_dim=14336,
               rope_theta=500000.0),
}


def _rss() -> Dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


def _cold_read_seconds(path: str) -> float:
    drop_from_page_cache(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass
    return time.perf_counter() - t0


def _elf_size(data: bytes, at: int) -> int:
    shoff, = struct.unpack_from("<Q", data, at + 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, at + 0x3A)
    return shoff + shentsize * shnum


def _code_bytes(path: str) -> int:
    """Size of the AOTI shared object inside the .pte (the first ELF image)."""
    with open(path, "rb") as f:
        data = f.read()
    at = data.find(b"\x7fELF")
    return _elf_size(data, at) if at >= 0 else -1


def export(shape: str, device: str, out: str) -> Dict[str, object]:
    """In its own process: build the random-weight model in bf16 and lower it."""
    import torch
    from executorch.exir import to_edge_transform_and_lower
    from model import ModelArgs, Transformer, _rope_inverse_frequencies, dynamic_shapes, example_inputs, \
        init_deterministic

    from offgraph_kv.partitioner import OffGraphKVPartitioner

    args = ModelArgs(**SHAPES[shape])
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = Transformer(args)
    # Materialise directly in bf16 (no fp32 copy of a 1.5 B-parameter model).
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    model.inv_freq.copy_(_rope_inverse_frequencies(args))
    init_deterministic(model, seed=0).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    t_model = time.perf_counter() - t0
    ep = torch.export.export(model, example_inputs(4), dynamic_shapes=dynamic_shapes(64))
    lowered = to_edge_transform_and_lower(ep, partitioner=[OffGraphKVPartitioner(device=device)])
    program = lowered.to_executorch()
    with open(out, "wb") as f:
        program.write_to_file(f)
    return {"shape": shape, "weight_bytes": weight_bytes, "model_build_s": t_model,
            "export_s": time.perf_counter() - t0 - t_model,
            "export_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


# Bytes per second the decode floor assumes (issue 14: weight bytes + KV bytes read per token / this).
H200_BYTES_PER_S = 4.3e12
MAX_WRITE = 64  # the export's widest step (dynamic_shapes below)


def _decode_at_contexts(method: object, token: "object", length: int, contexts: List[int], steps: int,
                        synchronize: object) -> List[Dict[str, float]]:
    """Fill the store to each context with the widest steps, then time ``steps`` decode steps there."""
    import torch

    rows = []
    for ctx in contexts:
        while length < ctx - 1:
            n = min(MAX_WRITE, ctx - 1 - length)
            ids = (torch.arange(length, length + n, dtype=torch.long) % 1000).unsqueeze(0)
            method.execute([ids, torch.arange(length, length + n, dtype=torch.long).unsqueeze(-1)])
            length += n
        times = []
        for _ in range(steps):
            synchronize()
            t0 = time.perf_counter()
            out = method.execute([token, torch.tensor([[length]], dtype=torch.long)])[0]
            times.append(time.perf_counter() - t0)
            token = out[:, -1:].argmax(-1)
            length += 1
        times.sort()
        rows.append({"context": ctx, "decode_ms_median": 1e3 * times[len(times) // 2],
                     "decode_ms_min": 1e3 * times[0], "finite_logits": bool(torch.isfinite(out).all())})
    return rows


def measure(path: str, decode_steps: int, contexts: "List[int] | None" = None) -> Dict[str, object]:
    """In its own process: load cold, one prefill step, a few decode steps (and decode at each context)."""
    import torch

    import offgraph_kv.runtime

    if offgraph_kv.runtime.pybindings_match_torch():
        # Import ExecuTorch's runtime before measuring: its own libraries are not the load's cost.
        from executorch.runtime import Runtime

        Runtime.get()
    cuda = torch.cuda.is_available() and os.environ.get("OFFGRAPH_KV_BENCH_DEVICE") == "cuda"
    device_used = (lambda: torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]) if cuda else (lambda: 0)
    drop_from_page_cache(path)
    before, dev_before = _rss(), device_used()
    t0 = time.perf_counter()
    method = offgraph_kv.runtime.load_method(path)
    load_s = time.perf_counter() - t0
    after_load, dev_after_load = _rss(), device_used()
    prompt = torch.arange(16, dtype=torch.long).unsqueeze(0) % 1000
    t0 = time.perf_counter()
    out = method.execute([prompt, torch.arange(16, dtype=torch.long).unsqueeze(-1)])[0]
    first_step_s = time.perf_counter() - t0
    after_step = _rss()
    token = out[:, -1:].argmax(-1)
    times = []
    for i in range(decode_steps):
        t0 = time.perf_counter()
        out = method.execute([token, torch.tensor([[16 + i]], dtype=torch.long)])[0]
        times.append(time.perf_counter() - t0)
        token = out[:, -1:].argmax(-1)
    metrics = offgraph_kv.runtime.stores()[-1].metrics()
    times.sort()
    sweep = _decode_at_contexts(method, token, 16 + decode_steps, contexts, max(decode_steps, 20),
                                torch.cuda.synchronize if cuda else (lambda: None)) if contexts else []
    return {"decode_at_context": sweep, "load_s": load_s, "first_step_s": first_step_s, "decode_ms_median": 1e3 * times[len(times) // 2],
            "rss_before": before, "rss_after_load": after_load, "rss_after_first_step": after_step,
            "device_used_added_at_load": dev_after_load - dev_before, "kv_allocated_bytes": metrics["allocated_bytes"],
            "finite_logits": bool(torch.isfinite(out).all())}


def _child(args: List[str], env: Dict[str, str], timeout: int) -> Dict[str, object]:
    done = subprocess.run([sys.executable, "-m", "benchmarks.cpu.weights", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}",
                "stderr_tail": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(shapes: List[str], variants: List[str], device: str, workdir: Path, decode_steps: int,
        contexts: "List[int] | None" = None, build_only: bool = False, reuse: bool = False) -> Dict[str, object]:
    """Export and measure each shape and variant; ``build_only`` keeps the programs
    (and their export records) in ``workdir`` for a later ``reuse`` run, which measures them."""
    workdir.mkdir(parents=True, exist_ok=True)
    results: List[Dict[str, object]] = []
    for shape in shapes:
        for variant in variants:
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
                       OFFGRAPH_KV_BENCH_DEVICE=device)
            env.pop("OFFGRAPH_KV_WEIGHTS_IN_CODE", None)
            if variant == "in-code":
                env["OFFGRAPH_KV_WEIGHTS_IN_CODE"] = "1"
            pte = workdir / f"{shape}_{variant}.pte"
            row: Dict[str, object] = {"shape": shape, "variant": variant, "device": device}
            record = pte.with_suffix(".export.json")
            if reuse and pte.exists() and record.exists():
                row["export"] = json.loads(record.read_text())
            else:
                print(f"[{shape} {variant}] export ...", flush=True)
                row["export"] = _child(["_export", shape, device, str(pte)], env, 3600)
                record.write_text(json.dumps(row["export"]))
            if "error" not in row["export"] and not build_only:
                row["pte_bytes"] = pte.stat().st_size
                row["code_bytes"] = _code_bytes(str(pte))
                row["cold_read_s"] = _cold_read_seconds(str(pte))
                print(f"[{shape} {variant}] measure ...", flush=True)
                row["run"] = _child(["_measure", str(pte), str(decode_steps), ",".join(map(str, contexts or []))],
                                    env, 1800)
                _summarise(row)
                pte.unlink()
                record.unlink()
            print(json.dumps(row, indent=1), flush=True)
            results.append(row)
    from benchmarks.lib import machine

    return {"date": machine.now_utc(), "machine": machine.describe(), "device": device, "results": results}


def _summarise(row: Dict[str, object]) -> None:
    r, w = row.get("run", {}), row["export"]["weight_bytes"]
    if "error" in r:
        return
    added_load = r["rss_after_load"]["VmRSS"] - r["rss_before"]["VmRSS"]
    added_step = r["rss_after_first_step"]["VmRSS"] - r["rss_before"]["VmRSS"]
    row["summary"] = {
        "weight_bytes": w,
        "code_bytes_over_weight_bytes": row["code_bytes"] / w,
        "rss_added_at_load_over_weights": added_load / w,
        "rss_added_after_first_step_over_weights": added_step / w,
        "anon_added_after_first_step_over_weights":
            (r["rss_after_first_step"]["RssAnon"] - r["rss_before"]["RssAnon"]) / w,
        "device_added_at_load_over_weights": r["device_used_added_at_load"] / w,
        "load_plus_first_step_over_cold_read": (r["load_s"] + r["first_step_s"]) / row["cold_read_s"],
    }
    shape = SHAPES[row["shape"]]
    # K and V rows of every layer, bf16: what one decode step reads per token of context.
    kv_per_token = 2 * shape["n_layers"] * shape["n_kv_heads"] * (shape["dim"] // shape["n_heads"]) * 2
    for c in r.get("decode_at_context", []):
        c["bytes_read"] = w + kv_per_token * c["context"]
        c["floor_ms"] = 1e3 * c["bytes_read"] / H200_BYTES_PER_S
        c["over_floor"] = c["decode_ms_median"] / c["floor_ms"]
        print(f"[{row['shape']}] decode at {c['context']:>6}: {c['decode_ms_median']:.3f} ms/token, "
              f"floor {c['floor_ms']:.3f} ms ({c['over_floor']:.2f}x)", flush=True)


def plot(result_files: List[Path], path: Path) -> Path:
    """Memory right after load over weight bytes, per shape and variant, from result JSONs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.lib.plots import finish_plot

    labels, host, device = [], [], []
    for f in result_files:
        for r in json.loads(f.read_text())["results"]:
            s = r.get("summary")
            if not s:
                labels.append(f"{r['shape']} {r['variant']} ({r['device']})\nfails to load")
                host.append(0.0)
                device.append(0.0)
                continue
            labels.append(f"{r['shape']} {r['variant']} ({r['device']})\n{s['weight_bytes'] / 1e9:.2f} GB")
            host.append(s["rss_added_at_load_over_weights"])
            device.append(s["device_added_at_load_over_weights"])
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels)), 4))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], host, width=0.4, label="host RSS added at load")
    ax.bar([x + 0.2 for x in xs], device, width=0.4, label="device memory added at load")
    ax.axhline(1.1, color="k", linestyle="--", linewidth=1, label="target 1.1 x weights")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.legend(fontsize=8)
    return Path(finish_plot(fig, ax, "", "x weight bytes", "Memory after load, weights outside vs in the code", str(path)))


def main(argv: "List[str] | None" = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--plot":
        out = plot([Path(f) for f in argv[2:]], Path(argv[1]))
        print(f"wrote {out}")
        return 0
    if argv and argv[0] == "_export":
        print(json.dumps(export(argv[1], argv[2], argv[3])))
        return 0
    if argv and argv[0] == "_measure":
        contexts = [int(c) for c in argv[3].split(",") if c] if len(argv) > 3 else []
        print(json.dumps(measure(argv[1], int(argv[2]), contexts)))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="small,1b")
    p.add_argument("--variants", default="in-code,outside")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--contexts", default="", help="also time decode at these contexts, e.g. 1024,8192,32768")
    p.add_argument("--workdir", default="/tmp/offgraph_kv_weights_bench")
    p.add_argument("--build-only", action="store_true", help="export and keep the programs for a later --reuse")
    p.add_argument("--reuse", action="store_true", help="measure programs a --build-only run left in --workdir")
    p.add_argument("--out", default=str(RESULTS / "weights_cpu.json"))
    a = p.parse_args(argv)
    contexts = [int(c) for c in a.contexts.split(",") if c]
    report = run(a.shapes.split(","), a.variants.split(","), a.device, Path(a.workdir), a.decode_steps, contexts,
                 a.build_only, a.reuse)
    if a.build_only:
        print(f"built in {a.workdir}")
        return 0
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
