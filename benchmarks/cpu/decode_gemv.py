"""CPU decode linears, SmolLM2 side by side in one process: our kernel, inductor's reduction, ATen's GEMM.

    python -m benchmarks.cpu.decode_gemv [--dtypes bf16,fp32] [--modes mm,reduce,auto] [--workdir DIR] [--reuse]

For each weight dtype, one program of SmolLM2-135M-Instruct (the wheel's
GGUF) per mode, exported by ``examples/llama/export.py`` with
``OFFGRAPH_KV_CPU_GEMV`` set to it (``backend/decode_gemv.py``): ``auto``
(the default: one row -> our kernel, ``backend/native/decode_linear.cpp``),
``reduce`` (each linear branches on the step's rows, one row -> inductor's
reduction) and ``mm`` (ATen's GEMM for every width). All are loaded in this
process and fed the same 200-token prompt in 64-token steps (prefill logits
must be equal: wider steps take the same path), then decoded greedily, each
from its own tokens, the programs taking turns step by step (one thread; the
machine is shared, so the ratios within the run are the numbers to read; each
is a mode's median over the first mode's). Writes JSON, a Markdown table and
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
MODES = ("mm", "reduce", "auto")


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
    base = next(iter(paths))
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return {"decode_ms_median": ms, "over_" + base: {k: v / ms[base] for k, v in ms.items()},
            "prefill_logits_equal": {k: bool(torch.equal(last[base], v)) for k, v in last.items()},
            "greedy_ids_equal": {k: sum(a == b for a, b in zip(ids[base], v)) for k, v in ids.items()},
            "steps": steps, "context": context}


def report(result: Dict[str, object], md: Path, png: Path) -> None:
    modes = result["modes"]
    base = modes[0]
    lines = [f"### CPU decode linears: {', '.join(modes)}, SmolLM2-135M ({result['date']})", "",
             f"`{result['command']}`; {result['machine'].get('cpu_model', '')}, one thread, the programs of "
             f"each dtype taking turns step by step in one process; ratios over `{base}`, prefill logits and "
             f"greedy ids against `{base}`'s.", "",
             "| weights + KV | mode | decode ms/token @200 | over " + base + " | prefill logits equal | "
             "greedy ids equal |", "|---|---|---:|---:|---|---:|"]
    for dtype, r in result["runs"].items():
        for mode in modes:
            lines.append(f"| {dtype} | {mode} | {r['decode_ms_median'][mode]:.2f} | {r['over_' + base][mode]:.2f} | "
                         f"{r['prefill_logits_equal'][mode]} | {r['greedy_ids_equal'][mode]}/{r['steps']} |")
    md.write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.lib.plots import finish_plot

    fig, ax = plt.subplots(figsize=(6, 3.5))
    dtypes = list(result["runs"])
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        ax.bar([i + width * j for i in range(len(dtypes))], [result["runs"][d]["decode_ms_median"][mode] for d in dtypes],
               width=width, label=mode)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(dtypes))], dtypes)
    finish_plot(fig, ax, "weights + KV", "decode ms/token @200", "SmolLM2 decode linears per mode", str(png))


def main(argv: "List[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--modes", default=",".join(MODES), help="OFFGRAPH_KV_CPU_GEMV modes; ratios over the first")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/offgraph_kv_decode_gemv"))
    p.add_argument("--reuse", action="store_true", help="use programs already exported into --workdir")
    p.add_argument("--out", type=Path, default=RESULTS / "cpu_decode_gemv.json")
    a = p.parse_args(argv)
    a.workdir.mkdir(parents=True, exist_ok=True)
    result: Dict[str, object] = {"date": now_utc(), "machine": describe(),
                                 "command": "python -m benchmarks.cpu.decode_gemv " + " ".join(argv or sys.argv[1:]),
                                 "modes": a.modes.split(","), "runs": {}, "export_s": {}}
    for dtype in a.dtypes.split(","):
        paths = {m: a.workdir / f"{dtype}_{m}.pte" for m in result["modes"]}
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
