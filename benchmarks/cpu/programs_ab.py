"""Two (or more) offgraph-kv programs of one model side by side, in turns, in one run: what a change
to the lowering or a kernel did to whole steps, prefills and memory.

    python -m benchmarks.cpu.programs_ab --program before=OLD.pte --program after=NEW.pte \\
        --out benchmarks/results/cpu_programs_ab.json

Each program is served by its own worker process (``benchmarks/lib/peer_worker.py``, one compute
thread), loaded once with its warm-up; then every round each program in turn decodes ``--steps``
greedy steps at each context (idle) and prefills each ``--prefill`` length from an empty cache in its
widest calls. The peak RSS is the worker's own (VmHWM less what it held before the load), read at the
end. Ratios are of each program against the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from benchmarks.cpu.peers import Worker, rotated, warm_page_cache
from benchmarks.lib.machine import describe, now_utc
from benchmarks.lib.plots import finish_plot
from benchmarks.lib.report import save

CONTEXTS = (200, 2000)


def measure(programs: Dict[str, str], rounds: int, steps: int, prefills: Sequence[int], threads: int,
            log: Path) -> Dict[str, Dict[str, object]]:
    from tqdm import tqdm

    names = list(programs)
    workers = {n: Worker(n, programs[n], threads, log, kind="offgraph") for n in names}
    raw: Dict[str, Dict[str, object]] = {n: {"decode": [], "prefill": []} for n in names}
    try:
        for w in workers.values():
            w.read()  # ready
        for n in names:
            warm_page_cache(programs[n])
            raw[n]["load"] = workers[n].ask(cmd="load", warm_up=True)
        with tqdm(total=rounds * len(names), desc="rounds") as bar:
            for r in range(rounds):
                for n in rotated(names, r):
                    raw[n]["decode"].append(workers[n].ask(cmd="decode", contexts=list(CONTEXTS), steps=steps,
                                                           busy_procs=0))
                    raw[n]["prefill"].append([workers[n].ask(cmd="prefill", tokens=t) for t in prefills])
                    bar.update()
        for n, w in workers.items():
            raw[n]["rss_end"] = w.ask(cmd="rss")
    finally:
        for w in workers.values():
            w.close()
    return raw


def summarize(raw: Dict[str, Dict[str, object]], prefills: Sequence[int]) -> List[Dict[str, object]]:
    rows = []
    for n, m in raw.items():
        row: Dict[str, object] = {"program": n, "load_s": m["load"]["load_s"],
                                  "rss_after_warm_up_mib": m["load"]["rss_after_warm_up_mib"],
                                  "peak_rss_mib": m["rss_end"]["peak_rss_mib"]}
        for c in CONTEXTS:
            row[f"decode_ms@{c}"] = statistics.median([s for d in m["decode"] for s in d[str(c)]["idle"]["step_ms"]])
        for i, t in enumerate(prefills):
            row[f"prefill_tok_s@{t}"] = statistics.median([p[i]["tokens_per_s"] for p in m["prefill"]])
        rows.append(row)
    first = rows[0]
    for row in rows:
        row["ratios"] = {k: row[k] / first[k] for k in row if k not in ("program", "ratios") and first[k]}
    return rows


def markdown(rows: List[Dict[str, object]], command: str, machine: Dict[str, object]) -> str:
    keys = [k for k in rows[0] if k not in ("program", "ratios")]
    head = "| program | " + " | ".join(keys) + " |\n|---|" + "---:|" * len(keys) + "\n"
    body = "".join(f"| {r['program']} | " + " | ".join(f"{r[k]:.3f} ({r['ratios'][k]:.2f}×)" for k in keys)
                   + " |\n" for r in rows)
    return (f"`{command}`; {machine.get('cpu_model')}, {machine.get('cores')} cores (shared); medians; "
            f"(×: against {rows[0]['program']})\n\n" + head + body)


def plot(rows: List[Dict[str, object]], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in rows[0] if k not in ("program", "ratios")]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        ax.bar([x + i * width for x in range(len(keys))], [r["ratios"][k] for k in keys], width, label=r["program"])
    ax.set_xticks([x + width * (len(rows) - 1) / 2 for x in range(len(keys))])
    ax.set_xticklabels(keys, rotation=20, fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8)
    return finish_plot(fig, ax, "", f"ratio to {rows[0]['program']}", "programs side by side, in turns", path)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--program", action="append", required=True, help="NAME=PATH.pte (the first is the baseline)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prefill", type=int, action="append", help="prompt lengths (default 512 and 2000)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True, help="JSON path; the .md and .png are written beside it")
    a = p.parse_args(argv)
    programs = dict(x.split("=", 1) for x in a.program)
    prefills = a.prefill or [512, 2000]
    out = Path(a.out)
    raw = measure(programs, a.rounds, a.steps, prefills, a.threads, out.with_suffix(".log"))
    rows = summarize(raw, prefills)
    command = "python -m benchmarks.cpu.programs_ab " + " ".join(f"--program {x}" for x in a.program) + \
        f" --rounds {a.rounds} --steps {a.steps} --out {a.out}"
    machine = describe()
    save({"date": now_utc(), "machine": machine, "command": command, "rows": rows, "raw": raw}, str(out))
    out.with_suffix(".md").write_text(markdown(rows, command, machine))
    plot(rows, str(out.with_suffix(".png")))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
