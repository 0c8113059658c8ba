"""Sessions, rewind and saved contexts (issue 20), measured on CPU.

One random-weight Llama-style program (``SHAPE`` below: dim 512, 8 layers,
8 q / 4 kv heads x 64, vocab 8192, fp32 weights ~134 MB, fp32 KV 16 KiB per
token), exported once; every measurement runs in its own process.

- **rewind**: ``store.rewind(n)`` on a 4,000-token store, per call (µs,
  through the Python binding), for n = 1 and n = 1,000.
- **save / load**: ``store.save`` / ``store.load`` of the 4,000-token context
  (GB/s of file bytes), against a plain ``write`` / ``read`` of a file of the
  same size in the same directory in the same run: to the page cache (what
  ``save`` does: no fsync), with fsync (the disk), and a cold read (the file
  dropped from the page cache first) beside a cold ``load``.
- **resume vs re-prefill**: the time to restore the 4,000-token context from
  its file against prefilling the same 4,000 tokens (chunks of 256), and the
  next step's logits from both (must be equal).
- **sessions memory**: RSS added by N = 1, 2, 4, 8 sessions of the program in
  one process (``offgraph_kv.runtime.Sessions``, one 16-token step each), against
  N separate loads (N processes, each paying the weights: N x one load).

    python -m benchmarks.cpu.sessions                      # ~5 min on 2 busy cores
    python -m benchmarks.cpu.sessions --out benchmarks/results/sessions_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

from benchmarks.lib.machine import drop_from_page_cache
from benchmarks.lib.paths import REPO, RESULTS, use_example_model

use_example_model()

SHAPE = dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=8192)
EXPORT_BOUND = 256  # widest step (prefill chunk)
CONTEXT = 4000
SESSION_COUNTS = (1, 2, 4, 8)
SESSION_STEP = 16


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found")


def export(out: str) -> Dict[str, object]:
    import torch
    from executorch.exir import to_edge_transform_and_lower
    from model import ModelArgs, Transformer, dynamic_shapes, example_inputs, init_deterministic

    from offgraph_kv.partitioner import OffGraphKVPartitioner

    args = ModelArgs(**SHAPE)
    model = init_deterministic(Transformer(args), seed=0).eval()
    t0 = time.perf_counter()
    ep = torch.export.export(model, example_inputs(4), dynamic_shapes=dynamic_shapes(EXPORT_BOUND))
    lowered = to_edge_transform_and_lower(
        ep, partitioner=[OffGraphKVPartitioner(storage_dtype=torch.float32, initial_capacity=256)])
    Path(out).write_bytes(lowered.to_executorch().buffer)
    return {"export_s": time.perf_counter() - t0, "pte_bytes": Path(out).stat().st_size,
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "kv_bytes_per_token": 2 * args.n_layers * args.n_kv_heads * args.head_dim * 4}


def _tokens(n: int, seed: int = 1):
    import torch

    return torch.randint(0, SHAPE["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def _prefill(method, tokens) -> object:
    from model import positions

    out = None
    for start in range(0, tokens.shape[1], EXPORT_BOUND):
        chunk = tokens[:, start:start + EXPORT_BOUND]
        out = method.execute([chunk, positions(start, chunk.shape[1])])[0]
    return out


def _plain_file_io(directory: Path, nbytes: int) -> Dict[str, float]:
    """The same bytes through plain write/read: the page cache and the disk, this run."""
    payload = os.urandom(nbytes)
    path = directory / "plain.bin"
    res: Dict[str, List[float]] = {"write_s": [], "write_fsync_s": [], "read_warm_s": [], "read_cold_s": []}
    for _ in range(3):
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            f.write(payload)
        res["write_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        res["write_fsync_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            f.read()
        res["read_warm_s"].append(time.perf_counter() - t0)
        drop_from_page_cache(str(path))
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            f.read()
        res["read_cold_s"].append(time.perf_counter() - t0)
    path.unlink()
    return {k: min(v) for k, v in res.items()}


def measure_contexts(pte: str, workdir: str) -> Dict[str, object]:
    import torch
    from model import positions

    from offgraph_kv.runtime import RuntimeMethod  # registers the backend

    directory = Path(workdir)
    method = RuntimeMethod(pte)
    store = method.store
    tokens = _tokens(CONTEXT)
    nxt = torch.tensor([[7]])

    # Prefill, three times (the first also warms the allocator); the fastest counts.
    prefill_s = []
    for _ in range(3):
        store.reset()
        t0 = time.perf_counter()
        _prefill(method, tokens)
        prefill_s.append(time.perf_counter() - t0)
    uninterrupted = method.execute([nxt, positions(CONTEXT, 1)])[0].clone()
    store.rewind(1)

    # Save / load of the 4,000-token context.
    path = directory / "context.ogkv"
    save_s = []
    for _ in range(3):
        t0 = time.perf_counter()
        store.save(str(path))
        save_s.append(time.perf_counter() - t0)
    file_bytes = path.stat().st_size
    resumed = RuntimeMethod(pte)  # a second session of the same program
    load_warm_s, load_cold_s = [], []
    for _ in range(3):
        resumed.store.reset()
        t0 = time.perf_counter()
        resumed.store.load(str(path))
        load_warm_s.append(time.perf_counter() - t0)
    for _ in range(3):
        resumed.store.reset()
        drop_from_page_cache(str(path))
        t0 = time.perf_counter()
        resumed.store.load(str(path))
        load_cold_s.append(time.perf_counter() - t0)

    # Rewind, per call: n = 1 from 4,000 down to 3,000, then n = 1,000 to 0.
    one = []
    for _ in range(1000):
        t0 = time.perf_counter_ns()
        store.rewind(1)
        one.append(time.perf_counter_ns() - t0)
    big = []
    for _ in range(3):
        t0 = time.perf_counter_ns()
        store.rewind(1000)
        big.append(time.perf_counter_ns() - t0)
    assert store.length == 0
    after_resume = resumed.execute([nxt, positions(CONTEXT, 1)])[0]
    metrics = resumed.store.metrics()
    plain = _plain_file_io(directory, file_bytes)
    path.unlink()
    gb = file_bytes / 1e9
    return {
        "context_tokens": CONTEXT,
        "kv_allocated_bytes": metrics["allocated_bytes"],
        "file_bytes": file_bytes,
        "prefill_s": min(prefill_s),
        "prefill_s_all": prefill_s,
        "rewind_1_us_median": statistics.median(one) / 1e3,
        "rewind_1_us_p99": sorted(one)[int(0.99 * len(one))] / 1e3,
        "rewind_1000_us_median": statistics.median(big) / 1e3,
        "rewind_1000_us_all": [b / 1e3 for b in big],
        "save_s": min(save_s),
        "load_warm_s": min(load_warm_s),
        "load_cold_s": min(load_cold_s),
        "save_gb_s": gb / min(save_s),
        "load_warm_gb_s": gb / min(load_warm_s),
        "load_cold_gb_s": gb / min(load_cold_s),
        "plain": plain,
        "plain_write_gb_s": gb / plain["write_s"],
        "plain_write_fsync_gb_s": gb / plain["write_fsync_s"],
        "plain_read_warm_gb_s": gb / plain["read_warm_s"],
        "plain_read_cold_gb_s": gb / plain["read_cold_s"],
        "resume_vs_prefill_speedup": min(prefill_s) / min(load_warm_s),
        "prefill_saved_s": min(prefill_s) - min(load_warm_s),
        "resumed_logits_equal_uninterrupted": bool(torch.equal(after_resume, uninterrupted)),
    }


def measure_sessions(pte: str, count: int) -> Dict[str, object]:
    from executorch.runtime import Runtime
    from model import positions

    import offgraph_kv.runtime

    Runtime.get()  # the runtime's own libraries before the first measurement
    tokens = _tokens(SESSION_STEP)
    before = _rss()
    t0 = time.perf_counter()
    sessions = offgraph_kv.runtime.Sessions(pte, count)
    load_s = time.perf_counter() - t0
    for s in sessions:
        s.execute([tokens, positions(0, SESSION_STEP)])
    after = _rss()
    kv = sum(s.store.metrics()["allocated_bytes"] for s in sessions)
    shared = offgraph_kv.runtime.shared_weights()
    assert [e["sessions"] for e in shared] == [count], shared
    return {"sessions": count, "rss_added": after - before, "kv_allocated_bytes": kv, "load_s": load_s,
            "shared_weight_bytes": shared[0]["weight_bytes"]}


def _child(args: List[str], timeout: int) -> Dict[str, object]:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    done = subprocess.run([sys.executable, "-m", "benchmarks.cpu.sessions", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{args[0]} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(workdir: Path) -> Dict[str, object]:
    from benchmarks.lib import machine

    workdir.mkdir(parents=True, exist_ok=True)
    pte = workdir / "sessions_bench.pte"
    t0 = time.perf_counter()
    print("export ...", flush=True)
    exported = _child(["_export", str(pte)], 1800)
    print("contexts ...", flush=True)
    contexts = _child(["_contexts", str(pte), str(workdir)], 1800)
    sessions = []
    for n in SESSION_COUNTS:
        print(f"sessions {n} ...", flush=True)
        sessions.append(_child(["_sessions", str(pte), str(n)], 900))
    one = sessions[0]["rss_added"]
    for row in sessions:
        row["separate_loads_rss"] = row["sessions"] * one  # N processes, each with its own weights
        row["rss_over_separate"] = row["rss_added"] / row["separate_loads_rss"]
        row["rss_added_beyond_first_over_weights"] = (row["rss_added"] - one) / exported["weight_bytes"]
    pte.unlink()
    return {"date": machine.now_utc(), "machine": machine.describe(), "shape": SHAPE, "export": exported,
            "contexts": contexts, "sessions": sessions, "total_s": time.perf_counter() - t0}


def summary_md(report: Dict[str, object]) -> str:
    c, e, m = report["contexts"], report["export"], report["machine"]
    mib = 2**20
    lines = [
        f"### Sessions, rewind and saved contexts, CPU ({report['date'][:10]})",
        "",
        f"{m['cpu_model']}, {m['cores']} cores (shared), torch {m['torch']}, executorch {m['executorch']}; "
        f"`python -m benchmarks.cpu.sessions`, {report['total_s'] / 60:.1f} min. Toy-sized random-weight model: "
        f"dim {SHAPE['dim']}, {SHAPE['n_layers']} layers, {SHAPE['n_heads']} q / {SHAPE['n_kv_heads']} kv heads x 64, "
        f"vocab {SHAPE['vocab_size']}, fp32 weights {e['weight_bytes'] / 1e6:.0f} MB, fp32 KV "
        f"{e['kv_bytes_per_token'] // 1024} KiB/token; 1 compute thread.",
        "",
        "| measurement | value |",
        "| --- | ---: |",
        f"| rewind(1) on a {CONTEXT}-token store | {c['rewind_1_us_median']:.2f} µs (p99 {c['rewind_1_us_p99']:.2f}) |",
        f"| rewind(1000) | {c['rewind_1000_us_median']:.2f} µs |",
        f"| saved context file ({CONTEXT} tokens) | {c['file_bytes'] / mib:.1f} MiB |",
        f"| save | {c['save_s'] * 1e3:.0f} ms = {c['save_gb_s']:.2f} GB/s |",
        f"| plain write of as many bytes (page cache / fsync'd to disk) | {c['plain_write_gb_s']:.2f} / "
        f"{c['plain_write_fsync_gb_s']:.2f} GB/s |",
        f"| load (file in page cache / cold) | {c['load_warm_s'] * 1e3:.0f} ms = {c['load_warm_gb_s']:.2f} GB/s / "
        f"{c['load_cold_s'] * 1e3:.0f} ms = {c['load_cold_gb_s']:.2f} GB/s |",
        f"| plain read of as many bytes (page cache / cold) | {c['plain_read_warm_gb_s']:.2f} / "
        f"{c['plain_read_cold_gb_s']:.2f} GB/s |",
        f"| prefill {CONTEXT} tokens (chunks of {EXPORT_BOUND}) | {c['prefill_s']:.2f} s |",
        f"| resume the same context from its file | {c['load_warm_s'] * 1e3:.0f} ms: "
        f"**{c['resume_vs_prefill_speedup']:.0f}x faster**, {c['prefill_saved_s']:.2f} s saved |",
        f"| next logits after resume == uninterrupted | {c['resumed_logits_equal_uninterrupted']} |",
        "",
        "| sessions | RSS added | KV allocated | N separate loads (N x one) | ratio | beyond the first session, x weights |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["sessions"]:
        lines.append(f"| {r['sessions']} | {r['rss_added'] / mib:.1f} MiB | {r['kv_allocated_bytes'] / mib:.1f} MiB | "
                     f"{r['separate_loads_rss'] / mib:.1f} MiB | {r['rss_over_separate']:.2f} | "
                     f"{r['rss_added_beyond_first_over_weights']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: "List[str] | None" = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_export":
        print(json.dumps(export(argv[1])))
        return 0
    if argv and argv[0] == "_contexts":
        print(json.dumps(measure_contexts(argv[1], argv[2])))
        return 0
    if argv and argv[0] == "_sessions":
        print(json.dumps(measure_sessions(argv[1], int(argv[2]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="/tmp/offgraph_kv_sessions_bench")
    p.add_argument("--out", default=str(RESULTS / "sessions_cpu.json"))
    a = p.parse_args(argv)
    report = run(Path(a.workdir))
    out = Path(a.out)
    out.write_text(json.dumps(report, indent=2) + "\n")
    md = out.with_suffix(".md")
    md.write_text(summary_md(report))
    print(summary_md(report))
    print(f"wrote {out} and {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
