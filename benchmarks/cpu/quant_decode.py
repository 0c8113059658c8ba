"""SmolLM2 quantized decode, programs side by side in one process: before and after the quantized-linear ops.

    python -m benchmarks.cpu.quant_decode --program NAME=PTE [--program NAME=PTE ...] [--steps 40] [--context 200]

Each ``NAME=PTE`` is an exported SmolLM2-135M program (``examples/llama/export.py
--quantize int8|int4``, e.g. one built before ``backend/quantized_linear.py``
and one after). All are loaded in this process and fed the same prompt in
64-token steps, then decode greedily, each from its own tokens, taking turns
step by step (one thread; the machine is shared, so the ratios within the run
are the numbers to read). Writes ``benchmarks/results/cpu_quant_decode.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List

from benchmarks.lib.machine import describe, now_utc
from benchmarks.lib.paths import RESULTS


def measure(paths: Dict[str, Path], steps: int, context: int) -> Dict[str, object]:
    import torch

    import offgraph_kv.runtime as rt

    from benchmarks.lib.interleaved import greedy_turns

    torch.set_num_threads(1)
    methods = {k: rt.load_method(str(p)) for k, p in paths.items()}
    _, times, ids = greedy_turns(methods, context, steps)
    return {"decode_ms_median": {k: 1e3 * statistics.median(v) for k, v in times.items()},
            "decode_ms_all": {k: [1e3 * t for t in v] for k, v in times.items()}, "ids": ids,
            "pte_bytes": {k: Path(p).stat().st_size for k, p in paths.items()}, "steps": steps, "context": context}


def report(result: Dict[str, object], md: Path, png: Path) -> None:
    r = result["run"]
    ms = r["decode_ms_median"]
    first = next(iter(ms))
    lines = [f"### SmolLM2-135M quantized decode, programs in turns ({result['date']})", "",
             f"`{result['command']}`; {result['machine'].get('cpu_model', '')}, one thread, decode at "
             f"{r['context']} tokens, {r['steps']} greedy steps each, programs taking turns step by step.", "",
             f"| program | .pte | decode ms/token (median) | / {first} |", "|---|---:|---:|---:|"]
    for k, v in ms.items():
        lines.append(f"| {k} | {r['pte_bytes'][k] / 2**20:.0f} MiB | {v:.2f} | {v / ms[first]:.2f} |")
    lines += ["", "Programs: " + ", ".join(f"{k} = `{p}`" for k, p in result["programs"].items())]
    md.write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.lib.plots import finish_plot

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(list(ms), list(ms.values()))
    ax.tick_params(axis="x", labelrotation=20)
    finish_plot(fig, ax, "program", f"decode ms/token @{r['context']}", "SmolLM2 quantized decode", str(png))


def main(argv: "List[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--program", action="append", required=True, help="NAME=PTE (repeat)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--out", type=Path, default=RESULTS / "cpu_quant_decode.json")
    a = p.parse_args(argv)
    programs = dict(s.split("=", 1) for s in a.program)
    run = measure({k: Path(v) for k, v in programs.items()}, a.steps, a.context)
    result = {"date": now_utc(), "machine": describe(), "programs": programs, "run": run,
              "command": "python -m benchmarks.cpu.quant_decode " + " ".join(argv if argv is not None else sys.argv[1:])}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    report(result, a.out.with_suffix(".md"), a.out.with_suffix(".png"))
    print(a.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
