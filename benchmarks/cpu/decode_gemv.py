"""CPU decode linears as reductions vs ATen's GEMM, SmolLM2 side by side in one process.

    python -m benchmarks.cpu.decode_gemv [--dtypes bf16,fp32] [--workdir DIR] [--reuse]

For each weight dtype, two programs of SmolLM2-135M-Instruct (the wheel's
GGUF) exported by ``examples/llama/export.py``: ``reduce`` (the default:
``backend/decode_gemv.py`` turns each linear into a branch on the step's rows,
a reduction for one row) and ``mm`` (``OFFGRAPH_KV_CPU_GEMV=mm``: ATen's GEMM
for every width, as before). Both are loaded in this process and fed the same
200-token prompt in 64-token steps (prefill logits must be equal: wider steps
take the same path), then decoded greedily, each from its own tokens, the two
programs taking turns step by step (one thread; the machine is shared, so the
ratio within the run is the number to read). Writes JSON, a Markdown table and
a bar plot.
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

from benchmarks.lib.machine import describe, now_utc
from benchmarks.lib.paths import REPO, RESULTS

EXPORT = REPO / "examples" / "llama" / "export.py"
MODES = ("mm", "reduce")


def export(dtype: str, mode: str, out: Path) -> float:
    """Export one program in a child process; returns its wall seconds."""
    env = dict(os.environ, OFFGRAPH_KV_CPU_GEMV=mode)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, str(EXPORT), "--out", str(out), "--dtype", dtype, "--storage-dtype", dtype,
                    "--quiet"], env=env, check=True)
    return time.perf_counter() - t0


def measure(paths: Dict[str, Path], steps: int, context: int) -> Dict[str, object]:
    import torch

    import offgraph_kv.runtime as rt

    from benchmarks.lib.interleaved import greedy_turns

    torch.set_num_threads(1)
    methods = {k: rt.load_method(p) for k, p in paths.items()}
    last, times, ids = greedy_turns(methods, context, steps)
    prefill_equal = bool(torch.equal(last["mm"], last["reduce"]))
    same = sum(a == b for a, b in zip(ids["mm"], ids["reduce"]))
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return {"decode_ms_median": ms, "reduce_over_mm": ms["reduce"] / ms["mm"], "prefill_logits_equal": prefill_equal,
            "greedy_ids_equal": same, "steps": steps, "context": context}


def report(result: Dict[str, object], md: Path, png: Path) -> None:
    lines = [f"### CPU decode linears: reductions vs ATen's GEMM, SmolLM2-135M ({result['date']})", "",
             f"`{result['command']}`; {result['machine'].get('cpu_model', '')}, one thread, the two programs of "
             "each dtype taking turns step by step in one process.", "",
             "| weights + KV | mm (ATen GEMM) ms/token | reduce ms/token | reduce / mm | prefill logits equal | "
             "greedy ids equal |", "|---|---:|---:|---:|---|---:|"]
    for dtype, r in result["runs"].items():
        ms = r["decode_ms_median"]
        lines.append(f"| {dtype} | {ms['mm']:.2f} | {ms['reduce']:.2f} | {r['reduce_over_mm']:.2f} | "
                     f"{r['prefill_logits_equal']} | {r['greedy_ids_equal']}/{r['steps']} |")
    md.write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.lib.plots import finish_plot

    fig, ax = plt.subplots(figsize=(6, 3.5))
    dtypes = list(result["runs"])
    for j, mode in enumerate(MODES):
        ax.bar([i + 0.4 * j for i in range(len(dtypes))], [result["runs"][d]["decode_ms_median"][mode] for d in dtypes],
               width=0.4, label=mode)
    ax.set_xticks([i + 0.2 for i in range(len(dtypes))], dtypes)
    finish_plot(fig, ax, "weights + KV", "decode ms/token @200", "SmolLM2 decode: reductions vs GEMM", str(png))


def main(argv: "List[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/offgraph_kv_decode_gemv"))
    p.add_argument("--reuse", action="store_true", help="use programs already exported into --workdir")
    p.add_argument("--out", type=Path, default=RESULTS / "cpu_decode_gemv.json")
    a = p.parse_args(argv)
    a.workdir.mkdir(parents=True, exist_ok=True)
    result: Dict[str, object] = {"date": now_utc(), "machine": describe(),
                                 "command": "python -m benchmarks.cpu.decode_gemv " + " ".join(argv or sys.argv[1:]),
                                 "runs": {}, "export_s": {}}
    for dtype in a.dtypes.split(","):
        paths = {m: a.workdir / f"{dtype}_{m}.pte" for m in MODES}
        for mode, path in paths.items():
            if not (a.reuse and path.exists()):
                result["export_s"][f"{dtype}_{mode}"] = export(dtype, mode, path)
        result["runs"][dtype] = measure(paths, a.steps, 200)
        print(dtype, json.dumps(result["runs"][dtype]), flush=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    report(result, a.out.with_suffix(".md"), a.out.with_suffix(".png"))
    print(a.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
