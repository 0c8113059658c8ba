"""Map growth against copy growth, side by side in one run: on the CPU, and on CUDA where there is a GPU.

    python -m benchmarks.cpu.growth_map --out benchmarks/results/growth_map_cpu.json [--steps] [--device cpu|cuda|all]

Copy growth allocates a new arena for every flat tensor, copies each tensor's
committed rows into it and releases the old one. Map growth reserves address
space for ``max_capacity`` rows of every flat tensor at load and backs more of
it as the store grows (host: ``mprotect`` of an ``mmap(PROT_NONE,
MAP_NORESERVE)`` range; CUDA: ``cuMemCreate`` + ``cuMemMap`` in allocation-
granularity chunks): nothing is copied and no address changes.

Measured, for a 32-layer Llama-3-8B-shaped store (8 KV heads x 128, bf16, K
and V: 128 KiB per token), growing from n to 2n rows:

- the growth alone (the store's own path through the benchmark hook), host
  wall clock and, on CUDA, stream time (events);
- the growth plus writing the new rows (``touch``): on the host map growth
  defers page faults to the first write, so this is the fair comparison;
- peak memory: the store's accounting (``peak_bytes``), and what the system
  saw: peak RSS over the growth on the host (VmHWM, reset before each case),
  device memory in use right after the growth on CUDA (cudaMemGetInfo);
- with ``--steps`` (CPU): step times of a real decode (the benchmark model,
  lowered once) through growths under each policy, passes alternating
  between the policies (per step, the smallest of three timed passes after a
  warm-up round), the time the growth steps take beyond their neighbours
  (``step_times.growth_share``), and the peak RSS over a decode from a reset.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

# Benchmark hooks: build with -C cmake.define.OFFGRAPH_KV_BENCHMARKS=ON (benchmarks/device/gpu_setup.sh does).
from offgraph_kv.runtime import _bench

# 32 layers, 8 KV heads, head dim 128, bf16: 128 KiB of KV per token (Llama-3-8B).
SHAPE = {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16"}
GROWTHS = ("copy", "map")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def hook_rows(device: str, sizes: "tuple[int, ...]", repeats: int) -> List[Dict[str, object]]:
    rows = []
    for before in sizes:
        for touch in (False, True):
            for growth in GROWTHS:
                if device == "cuda":
                    torch.cuda.synchronize()
                rss0 = _status_kib("VmRSS")
                peak_ok = _reset_peak_rss()
                t = _bench.time_growth(device, SHAPE["layers"], SHAPE["kv_heads"], SHAPE["head_dim"], SHAPE["dtype"],
                                       before, 2 * before, repeats, "auto", True, growth, touch)
                row = {"device": device, "growth": t["growth"], "asked": growth, "touch": touch,
                       "rows_before": before, "rows_after": 2 * before,
                       "growth_wall_ms": t["seconds"] * 1e3, "growth_device_ms": t["device_seconds"] * 1e3,
                       "bytes_copied": t["bytes_copied"], "store_peak_bytes": t["peak_bytes"],
                       "store_allocated_bytes": t["allocated_bytes"]}
                if device == "cuda":
                    row["device_peak_bytes"] = t["device_peak_bytes"]
                elif peak_ok:
                    row["peak_rss_bytes"] = (_status_kib("VmHWM") - rss0) * 1024
                rows.append(row)
                peak = row.get("device_peak_bytes", row.get("peak_rss_bytes", 0))
                print(f"{device:>4} {growth:>4}{' +touch' if touch else '       '} {before:>6} -> {2 * before:>6} rows  "
                      f"growth {row['growth_wall_ms']:9.3f} ms (device {row['growth_device_ms']:8.3f} ms)  "
                      f"copied {row['bytes_copied'] / 2**20:7.1f} MiB  store peak {row['store_peak_bytes'] / 2**20:7.1f} MiB  "
                      f"{'device' if device == 'cuda' else 'RSS'} peak {peak / 2**20:7.1f} MiB", flush=True)
    return rows


def _compare(rows: List[Dict[str, object]]) -> List[Dict[str, object]]:
    """Map over copy, per size and touch: time and peak ratios (< 1: map is better)."""
    out = []
    by = {(r["device"], r["rows_before"], r["touch"], r["asked"]): r for r in rows}
    for (device, before, touch, asked), m in by.items():
        if asked != "map" or (device, before, touch, "copy") not in by:
            continue
        c = by[(device, before, touch, "copy")]
        key = "device_peak_bytes" if device == "cuda" else "peak_rss_bytes"
        out.append({
            "device": device, "rows_before": before, "touch": touch,
            "map_over_copy_time": m["growth_wall_ms"] / c["growth_wall_ms"] if c["growth_wall_ms"] else None,
            "map_over_copy_store_peak": m["store_peak_bytes"] / c["store_peak_bytes"],
            "map_over_copy_system_peak": (m[key] / c[key]) if c.get(key) else None,
        })
    return out


def step_rows(decode_to: int, initial: int, workdir: Path) -> Dict[str, object]:
    """A real decode through growths under each policy (CPU): step times, growth steps' extra time, peak RSS."""
    import offgraph_kv.runtime as ogr
    from executorch.runtime import Runtime

    from benchmarks.lib.artifacts import MODEL_SHAPE, build_offgraph, model_args, write_weights
    from benchmarks.lib.step_times import growth_share
    from model import positions

    workdir.mkdir(parents=True, exist_ok=True)
    write_weights(workdir)
    pte = workdir / "offgraph.pte"
    t0 = time.perf_counter()
    build_offgraph(workdir, 2 * decode_to, 32, pte)
    built_s = time.perf_counter() - t0
    ids = torch.randint(0, model_args().vocab_size, (decode_to,), generator=torch.Generator().manual_seed(1))
    runs: Dict[str, Dict[str, object]] = {}
    final: Dict[str, torch.Tensor] = {}
    loaded = {}
    for growth in GROWTHS:
        ogr.configure(growth=growth, initial_capacity=initial)
        try:
            method = Runtime.get().load_program(str(pte)).load_method("forward")
            loaded[growth] = (method, ogr.stores()[-1])
        finally:
            ogr.configure()
    passes: Dict[str, List[tuple]] = {g: [] for g in GROWTHS}
    peak_rss: Dict[str, int] = {}
    # Passes alternate between the policies (copy, map, copy, map, ...): load on a
    # shared machine comes and goes, and alternating spreads it over both alike.
    for p in range(4):  # the first round warms up (code pages, allocator); the others are timed
        for growth in GROWTHS:
            method, store = loaded[growth]
            store.reset(release_memory=True)
            rss0 = _status_kib("VmRSS")
            _reset_peak_rss()
            times, grew, cap = [], [], store.capacity
            for i in range(decode_to):
                t = time.perf_counter()
                out = method.execute([ids[i].view(1, 1), positions(i, 1)])[0]
                times.append(time.perf_counter() - t)
                grew.append(store.capacity != cap)
                cap = store.capacity
            peak_rss[growth] = max(peak_rss.get(growth, 0), (_status_kib("VmHWM") - rss0) * 1024)
            if p:
                passes[growth].append((times, grew))
            final[growth] = out.clone()
    for growth in GROWTHS:
        method, store = loaded[growth]
        # Per step the smallest of the timed passes: noise on a shared machine only ever adds time.
        times = [min(ts) for ts in zip(*(t for t, _ in passes[growth]))]
        grew = passes[growth][-1][1]
        m = store.metrics()
        share = growth_share(times, grew)
        runs[growth] = {
            "growth_in_effect": m["growth"], "growths": m["growths"], "capacity": m["capacity"],
            "median_step_ms": statistics.median(times) * 1e3,
            "median_step_ms_per_pass": [statistics.median(t) * 1e3 for t, _ in passes[growth]],
            "growth_steps": share["growth_steps"], "growth_extra_ms": share["growth_extra_ms"],
            "growth_time_share": share["growth_time_share"], "decode_total_ms": share["decode_total_ms"],
            "store_peak_bytes": m["peak_bytes"], "store_allocated_bytes": m["allocated_bytes"],
            "reserved_bytes": m["reserved_bytes"], "peak_rss_bytes_over_a_decode_from_reset": peak_rss[growth],
        }
        print(f" cpu steps {growth:>4}: {m['growths']} growths to {m['capacity']} rows, median step "
              f"{runs[growth]['median_step_ms']:.3f} ms (per pass {[round(x, 3) for x in runs[growth]['median_step_ms_per_pass']]}), "
              f"growth steps' extra {share['growth_extra_ms']:.2f} ms ({100 * (share['growth_time_share'] or 0):.2f} % of "
              f"decode), per growth step {[round(g['extra_ms'], 2) for g in share['growth_steps']]} ms, peak RSS over a "
              f"decode {peak_rss[growth] / 2**20:.1f} MiB", flush=True)
    same = bool(torch.equal(final["map"], final["copy"]))
    print(f" cpu steps: last logits of map and copy identical: {same}")
    return {"model": MODEL_SHAPE, "storage_dtype": "fp32", "initial_capacity": initial, "decode_to": decode_to,
            "build_seconds": built_s, "runs": runs, "same_logits": same}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--device", choices=("cpu", "cuda", "all"), default="all")
    p.add_argument("--cpu-sizes", default="1024,4096", help="rows before each CPU growth (to twice that)")
    p.add_argument("--cuda-sizes", default="1024,4096,16384,32768")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", action="store_true", help="also a real CPU decode through growths under each policy")
    p.add_argument("--decode-to", type=int, default=4096)
    args = p.parse_args(argv)
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    if "cuda" in devices and not torch.cuda.is_available():
        devices.remove("cuda")
    rows: List[Dict[str, object]] = []
    for d in devices:
        sizes = tuple(int(x) for x in (args.cpu_sizes if d == "cpu" else args.cuda_sizes).split(","))
        rows += hook_rows(d, sizes, args.repeats)
    result: Dict[str, object] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if "cuda" in devices else None,
        "command": "python -m benchmarks.cpu.growth_map " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "shape": SHAPE, "growth": rows, "map_over_copy": _compare(rows),
    }
    # What reserving 1M rows of the 8B-shaped store costs (CUDA: device memory, by cudaMemGetInfo).
    result["reservation_1M_rows"] = {}
    for d in devices:
        rss0 = _status_kib("VmRSS")
        c = _bench.reservation_cost(d, SHAPE["layers"], SHAPE["kv_heads"], SHAPE["head_dim"], SHAPE["dtype"], 256, 1 << 20)
        if d == "cpu":
            c["rss_delta"] = (_status_kib("VmRSS") - rss0) * 1024
        result["reservation_1M_rows"][d] = c
        print(f"{d:>4} 1M-row store ({c['growth']}): reserved {c['reserved_bytes'] / 2**30:.1f} GiB of address space, "
              f"backed {c['allocated_bytes'] / 2**20:.1f} MiB (the initial 256 rows in whole chunks), device memory "
              f"taken {c['device_used_delta'] / 2**20:.1f} MiB {c['note']}", flush=True)
    if args.steps:
        with tempfile.TemporaryDirectory() as tmp:
            result["cpu_steps"] = step_rows(args.decode_to, 256, Path(tmp))
    for c in result["map_over_copy"]:
        print(f"{c['device']:>4} {c['rows_before']:>6} rows{' +touch' if c['touch'] else ''}: map/copy time "
              f"{c['map_over_copy_time']:.3f}, store peak {c['map_over_copy_store_peak']:.2f}, system peak "
              f"{c['map_over_copy_system_peak'] if c['map_over_copy_system_peak'] is None else round(c['map_over_copy_system_peak'], 2)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
