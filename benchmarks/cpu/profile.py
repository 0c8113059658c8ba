"""Where a SmolLM2 decode step's time goes on CPU, per kernel; and programs compared side by side.

    python -m benchmarks.cpu.profile [--dtype bf16] [--linear aten,cpp] [--context 200] [--steps 20]

For each CPU linear kernel named (``OFFGRAPH_KV_CPU_LINEAR``, see
``backend/aoti_compile.py``), SmolLM2-135M-Instruct is exported by the
example's ``export.py`` with inductor's kernel profiling compiled in
(``TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1``: every generated C++ kernel
records itself to the PyTorch profiler; ATen ops the code calls through its
C shim record themselves). All programs are then loaded into this one
process (one compute thread) and:

1. profiled: filled to ``--context`` tokens, then ``--steps`` decode steps
   under ``torch.profiler``; per event name, the self time per step and its
   share of the step (kernels of one kind, e.g. the 30 layers' ``aten::mm``,
   are one row; the profile's ``record_shapes`` tells the GEMMs apart);
2. timed without the profiler, interleaved: ``--turns`` turns of ``--window``
   decode steps each at ``--context``, and ``--prefill`` tokens of prefill in
   the program's 64-token chunks, the programs taking turns, so that load
   from other jobs on the shared cores lands on all of them alike.

Results: ``benchmarks/results/cpu_profile_smollm2_<dtype>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from benchmarks.lib.paths import REPO, RESULTS  # noqa: E402

EXPORT = REPO / "examples" / "llama" / "export.py"
VOCAB = 49_152
MAX_WRITE = 64


def export(kind: str, dtype: str, workdir: Path, reuse: bool) -> Path:
    """SmolLM2 exported with CPU linear kernel ``kind`` and kernel profiling compiled in."""
    pte = workdir / f"smollm2_{dtype}_{kind}_profiled.pte"
    if reuse and pte.exists():
        return pte
    env = dict(os.environ, TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE="1", OFFGRAPH_KV_CPU_LINEAR=kind)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, str(EXPORT), "--out", str(pte), "--dtype", dtype,
                           "--max-write", str(MAX_WRITE), "--quiet"], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"export ({kind}) failed:\n{done.stderr[-3000:]}")
    pte.with_suffix(".export_s").write_text(repr(time.perf_counter() - t0))
    return pte


def profile_decode(prog: object, context: int, steps: int) -> Dict[str, object]:
    """``steps`` decode steps after ``context`` tokens under the profiler: per event, ms per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.lib.interleaved import fill
    from benchmarks.lib.measure import token_ids

    fill(prog, context, VOCAB)
    ids = token_ids(steps + 2, VOCAB, seed=3)
    prog.step(ids[0].view(1, 1), context)  # warm
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            prog.step(ids[i + 1].view(1, 1), context + 1 + i)
        wall = (time.perf_counter() - t0) / steps
    # Top-level events only (no double counting). An ATen op the code calls through
    # its C shim (aoti_torch_cpu_mm_out, ...) runs the op's kernel directly (no
    # dispatcher event of its own); the shapes of the tensors it resolves (out,
    # then input) tell the GEMMs of different shapes apart.
    rows: Dict[str, Dict[str, float]] = defaultdict(lambda: {"ms": 0.0, "calls": 0})
    for e in prof.events():
        if e.cpu_parent is not None or e.name.startswith("ProfilerStep"):
            continue
        key = e.name.removeprefix("graph_0_")
        if key.startswith("aoti_torch_") and e.cpu_children:
            shapes = [c.input_shapes[0] for c in e.cpu_children if c.input_shapes]
            key = f"{key.removeprefix('aoti_torch_cpu_')} (out, input: {shapes})"
        elif key.startswith("aten::") and e.input_shapes:
            key = f"{key} {e.input_shapes}"
        rows[key]["ms"] += e.cpu_time_total / 1e3 / steps
        rows[key]["calls"] += 1 / steps
    total = sum(r["ms"] for r in rows.values())
    top = sorted(({"kernel": k, "ms_per_step": r["ms"], "calls_per_step": r["calls"],
                   "share_of_step": r["ms"] / (wall * 1e3)} for k, r in rows.items()),
                 key=lambda r: -r["ms_per_step"])
    torch.set_num_threads(1)
    return {"step_ms_profiled": wall * 1e3, "events_ms_per_step": total, "kernels": top}


def timed(progs: Dict[str, object], context: int, window: int, turns: int, prefill: int,
          repeats: int) -> Dict[str, Dict[str, object]]:
    """Decode at ``context`` and a ``prefill``-token prefill, the programs interleaved."""
    from benchmarks.lib.interleaved import fill
    from benchmarks.lib.measure import token_ids

    out: Dict[str, Dict[str, object]] = {k: {"decode_ms": [], "prefill_s": []} for k in progs}
    for p in progs.values():
        fill(p, context, VOCAB)
    pos = {k: context for k in progs}
    ids = token_ids(window * turns, VOCAB, seed=11)
    for turn in range(turns):
        for k, p in progs.items():
            for j in range(window):
                t0 = time.perf_counter()
                p.step(ids[turn * window + j].view(1, 1), pos[k])
                out[k]["decode_ms"].append((time.perf_counter() - t0) * 1e3)
                pos[k] += 1
    prompt = token_ids(prefill, VOCAB, seed=5).view(1, -1)
    for _ in range(repeats):
        for k, p in progs.items():
            p.reset()
            t0 = time.perf_counter()
            for s in range(0, prefill, MAX_WRITE):
                p.step(prompt[:, s:s + MAX_WRITE], s)
            out[k]["prefill_s"].append(time.perf_counter() - t0)
    return {k: {"decode_ms_median": statistics.median(v["decode_ms"]),
                "decode_turn_medians_ms": [round(statistics.median(v["decode_ms"][t * window:(t + 1) * window]), 3)
                                           for t in range(turns)],
                "prefill_tok_s_best": prefill / min(v["prefill_s"]),
                "prefill_tok_s_median": prefill / statistics.median(v["prefill_s"])} for k, v in out.items()}


def markdown(result: Dict[str, object], top: int = 15) -> str:
    lines = [f"### SmolLM2-135M-Instruct decode on CPU, per kernel ({result['date']})", "",
             f"`{result['command']}`; {result['machine'].get('cpu_model', '')}, one thread, "
             f"{result['dtype']} weights, bf16 KV, context {result['context']}.", ""]
    t = result["timed"]
    lines += ["| CPU linear kernel | decode ms/token (median) | prefill tok/s (best / median) |", "|---|---:|---:|"]
    for k, v in t.items():
        lines.append(f"| {k} | {v['decode_ms_median']:.2f} | {v['prefill_tok_s_best']:.0f} / "
                     f"{v['prefill_tok_s_median']:.0f} |")
    for k, prof in result["profiles"].items():
        lines += ["", f"#### {k}: {prof['step_ms_profiled']:.2f} ms per profiled step", "",
                  "| kernel (ATen ops: input shapes) | ms / step | calls / step | share of step |", "|---|---:|---:|---:|"]
        for r in prof["kernels"][:top]:
            lines.append(f"| `{r['kernel'][:110]}` | {r['ms_per_step']:.3f} | {r['calls_per_step']:.0f} | "
                         f"{r['share_of_step']:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: "List[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--linear", default="aten,cpp", help="CPU linear kernels to export and compare")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--steps", type=int, default=20, help="profiled decode steps")
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--reuse", action="store_true", help="programs already in --workdir are not exported again")
    p.add_argument("--workdir", type=Path, default=Path("/tmp") / f"offgraph_kv_profile_{os.getuid()}")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    a.workdir.mkdir(parents=True, exist_ok=True)
    kinds = a.linear.split(",")
    ptes = {k: export(k, a.dtype, a.workdir, a.reuse) for k in kinds}

    import torch

    from benchmarks.lib.machine import describe, now_utc
    from benchmarks.lib.measure import OffGraphProgram

    torch.set_num_threads(1)
    progs = {k: OffGraphProgram(str(ptes[k]), 4096, MAX_WRITE) for k in kinds}
    profiles = {k: profile_decode(progs[k], a.context, a.steps) for k in kinds}
    result = {"date": now_utc(), "machine": describe(), "dtype": a.dtype, "context": a.context,
              "command": "python -m benchmarks.cpu.profile " + " ".join(argv if argv is not None else sys.argv[1:]),
              "export_s": {k: float(ptes[k].with_suffix(".export_s").read_text())
                           for k in kinds if ptes[k].with_suffix(".export_s").exists()},
              "pte_bytes": {k: ptes[k].stat().st_size for k in kinds},
              "timed": timed(progs, a.context, a.window, a.turns, a.prefill, a.repeats), "profiles": profiles}
    out = a.out or RESULTS / f"cpu_profile_smollm2_{a.dtype}.json"
    out.write_text(json.dumps(result, indent=1))
    md = markdown(result)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
