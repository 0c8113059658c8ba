"""Threads of the compiled code on a busy machine: 1 and 2 threads, idle and
with a busy process per core, interleaved in one run.

    python -m benchmarks.cpu.threads --pte smollm2.pte --out benchmarks/results/cpu_threads.json

One process loads the program three times (sessions: weights shared, a store
each) with the load-time option ``num_threads`` = 1, 2 and unset (the
runtime's default), and prefills each to ``--context`` tokens. Then, for
``--rounds`` rounds, under each condition in turn (idle; one
``while True: pass`` process per core), every session takes ``--steps``
decode steps and ``--prefills`` prefill chunks of ``--chunk`` tokens, each
timed alone and then rewound (``store.rewind``), so every step sees the same
context. Conditions and sessions alternate their order from round to round,
so slow drift of the machine lands on all of them alike.

Reported per session and condition: median, 90th percentile and worst step;
the busy / idle ratios (what a busy machine costs each thread count) and the
2-thread / 1-thread ratios (what the second thread buys). Other processes'
share of the cores during the idle windows is recorded too: this benchmark
runs on machines other people use.

Self-contained on purpose (it imports only ``benchmarks.lib.machine``); the
OpenMP wait policy is libgomp's at process start, so ``--wait-policy`` sets
``OMP_WAIT_POLICY`` before torch loads (a separate run per policy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

# libgomp reads its wait policy once, when it is loaded (with torch).
if __name__ == "__main__":
    _w = next((sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == "--wait-policy"), None)
    if _w and _w != "default":
        os.environ["OMP_WAIT_POLICY"] = _w

import torch  # noqa: E402

import offgraph_kv.runtime as ogr  # noqa: E402
from executorch.runtime import Runtime  # noqa: E402

from benchmarks.lib.machine import Busy, Contention, describe, now_utc  # noqa: E402

SESSIONS = {"1 thread": 1, "2 threads": 2, "default": None}
CONDITIONS = ("idle", "busy")


def positions(start: int, width: int) -> torch.Tensor:
    # The Llama example's input_pos: [T, 1] int64 positions (examples/llama/model.py).
    return torch.arange(start, start + width, dtype=torch.long).view(width, 1)


class Session:
    def __init__(self, path: str, threads: Optional[int]) -> None:
        ogr.configure(num_threads=threads)
        try:
            # A Program per session: executorch.runtime keeps one Method per name on a Program.
            self.method = Runtime.get().load_program(path).load_method("forward")
        finally:
            ogr.configure()
        self.store = ogr.stores()[-1]

    def step(self, tokens: torch.Tensor) -> float:
        start = self.store.length
        t = time.perf_counter()
        self.method.execute([tokens, positions(start, tokens.shape[1])])
        return time.perf_counter() - t


def summary(ms: List[float]) -> Dict[str, float]:
    s = sorted(ms)
    return {"n": len(s), "median_ms": statistics.median(s), "p90_ms": s[min(len(s) - 1, int(0.9 * len(s)))],
            "worst_ms": s[-1], "mean_ms": statistics.fmean(s)}


def run(path: str, context: int, steps: int, prefills: int, chunk: int, rounds: int, busy_procs: int,
        vocab: int) -> Dict[str, object]:
    torch.manual_seed(0)
    sessions = {name: Session(path, n) for name, n in SESSIONS.items()}
    ids = torch.randint(0, vocab, (context + steps + chunk,), generator=torch.Generator().manual_seed(7))
    for s in sessions.values():  # the same context in every store
        at = 0
        while at < context:
            w = min(chunk, context - at)
            s.step(ids[at:at + w].view(1, -1))
            at += w
    decode = {n: {c: [] for c in CONDITIONS} for n in sessions}
    prefill = {n: {c: [] for c in CONDITIONS} for n in sessions}
    idle_others: List[Optional[float]] = []
    names = list(sessions)
    for r in range(rounds):
        for cond in (CONDITIONS if r % 2 == 0 else CONDITIONS[::-1]):
            busy = Busy(busy_procs if cond == "busy" else 0)
            with busy:
                watch = Contention()
                for name in (names if r % 2 == 0 else names[::-1]):
                    s = sessions[name]
                    for k in range(steps):
                        decode[name][cond].append(s.step(ids[context + k].view(1, 1)) * 1e3)
                    s.store.rewind(steps)
                    for _ in range(prefills):
                        prefill[name][cond].append(s.step(ids[context:context + chunk].view(1, -1)) * 1e3)
                        s.store.rewind(chunk)
                if cond == "idle":
                    idle_others.append(watch.others_fraction())
    result: Dict[str, object] = {"decode": {}, "prefill": {}, "ratios": {}}
    for kind, table in (("decode", decode), ("prefill", prefill)):
        for name in names:
            result[kind][name] = {c: dict(summary(table[name][c]), all_ms=[round(x, 3) for x in table[name][c]])
                                  for c in CONDITIONS}
    for kind in ("decode", "prefill"):
        res = result[kind]
        ratios: Dict[str, float] = {}
        for name in names:
            for stat in ("median_ms", "worst_ms"):
                ratios[f"{name}: busy/idle {stat[:-3]}"] = res[name]["busy"][stat] / res[name]["idle"][stat]
        for cond in CONDITIONS:
            for stat in ("median_ms", "worst_ms"):
                ratios[f"{cond}: 2 threads/1 thread {stat[:-3]}"] = (res["2 threads"][cond][stat]
                                                                     / res["1 thread"][cond][stat])
                ratios[f"{cond}: default/1 thread {stat[:-3]}"] = (res["default"][cond][stat]
                                                                  / res["1 thread"][cond][stat])
        result["ratios"][kind] = ratios
    result["others_busy_in_idle_windows"] = idle_others
    return result


def by_round(result: Dict[str, object], clean_below: float = 0.1) -> None:
    """Per-round medians (the ``all_ms`` lists are in time order, ``steps`` /
    ``prefills`` per round), and the summary over the rounds whose idle window
    had other processes on under ``clean_below`` of the cores: on a shared
    machine someone else's job can turn an "idle" round into a busy one."""
    cfg = result["config"]
    others = result["others_busy_in_idle_windows"]
    rounds = []
    for r, share in enumerate(others):
        row: Dict[str, object] = {"others_busy_in_idle_window": share}
        for kind, k in (("decode", cfg["steps"]), ("prefill", cfg["prefills"])):
            row[kind] = {n: {c: statistics.median(per[c]["all_ms"][r * k:(r + 1) * k]) for c in CONDITIONS}
                         for n, per in result[kind].items()}
        rounds.append(row)
    result["rounds"] = rounds
    clean = [r for r, share in enumerate(others) if share is not None and share < clean_below]
    result["clean_rounds"] = clean
    summary: Dict[str, object] = {}
    for kind, k in (("decode", cfg["steps"]), ("prefill", cfg["prefills"])):
        summary[kind] = {}
        for n, per in result[kind].items():
            summary[kind][n] = {}
            for c in CONDITIONS:
                ms = [x for r in clean for x in per[c]["all_ms"][r * k:(r + 1) * k]]
                summary[kind][n][c] = summary_of(ms) if ms else None
    result["clean_summary"] = summary


def summary_of(ms: List[float]) -> Dict[str, float]:
    return summary(ms)


def plot(result: Dict[str, object], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, kind in zip(axes, ("decode", "prefill")):
        labels, data = [], []
        for name, per in result[kind].items():
            for cond in CONDITIONS:
                labels.append(f"{name}\n{cond}")
                data.append(per[cond]["all_ms"])
        ax.boxplot(data, whis=(0, 100))
        ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("ms per step")
        width = 1 if kind == "decode" else result["config"]["chunk"]
        ax.set_title(f"{kind}: {width}-token steps at {result['config']['context']} tokens of context")
        ax.grid(axis="y", alpha=0.3)
    shares = ", ".join("?" if x is None else f"{x:.0%}" for x in result["others_busy_in_idle_windows"])
    fig.suptitle(f"{Path(result['config']['pte']).name}: num_threads, idle vs one busy process per core, all rounds "
                 f"(whiskers: min / worst); other jobs' share of the cores in each round's idle window: {shares}",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pte", help="an offgraph-kv program (e.g. examples/llama/export.py's SmolLM2)")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--steps", type=int, default=20, help="decode steps per session per condition per round")
    p.add_argument("--prefills", type=int, default=2, help="prefill chunks per session per condition per round")
    p.add_argument("--chunk", type=int, default=64, help="tokens per prefill chunk (<= the program's max_write)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="busy processes (default: one per core)")
    p.add_argument("--vocab", type=int, default=1000, help="token ids are drawn below this")
    p.add_argument("--wait-policy", default="default", help="OMP_WAIT_POLICY for this run (read at start)")
    p.add_argument("--out", required=True)
    p.add_argument("--plot", help="PNG path (default: --out with .png)")
    p.add_argument("--reanalyze", action="store_true", help="recompute the per-round fields of --out's JSON only")
    a = p.parse_args(argv)
    if a.reanalyze:
        result = json.loads(Path(a.out).read_text())
        by_round(result)
        Path(a.out).write_text(json.dumps(result, indent=1))
        plot(result, Path(a.plot) if a.plot else Path(a.out).with_suffix(".png"))
        print_rounds(result)
        return 0
    started = now_utc()
    t0 = time.perf_counter()
    result = run(a.pte, a.context, a.steps, a.prefills, a.chunk, a.rounds, a.busy, a.vocab)
    result["config"] = {k: getattr(a, k) for k in ("pte", "context", "steps", "prefills", "chunk", "rounds", "busy",
                                                   "wait_policy")}
    result["config"]["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY")
    result["config"]["torch_threads_in_process"] = torch.get_num_threads()
    result["machine"] = describe()
    result["started_utc"], result["seconds"] = started, time.perf_counter() - t0
    result["command"] = " ".join([Path(sys.executable).name, "-m", "benchmarks.cpu.threads"] + (argv or sys.argv[1:]))
    by_round(result)
    out = Path(a.out)
    out.write_text(json.dumps(result, indent=1))
    try:
        plot(result, Path(a.plot) if a.plot else out.with_suffix(".png"))
    except ImportError as e:
        print(f"plot skipped ({e}); pip install matplotlib")
    for kind in ("decode", "prefill"):
        for name, per in result[kind].items():
            print(f"{kind:8s} {name:10s} " + "  ".join(
                f"{c}: median {per[c]['median_ms']:.1f} worst {per[c]['worst_ms']:.1f} ms" for c in CONDITIONS))
        for k, v in result["ratios"][kind].items():
            print(f"  {kind} {k}: {v:.2f}")
    print("others' share of the cores in idle windows:",
          [None if x is None else round(x, 3) for x in result["others_busy_in_idle_windows"]])
    print_rounds(result)


def print_rounds(result: Dict[str, object]) -> None:
    for kind in ("decode", "prefill"):
        for n in result[kind]:
            for c in CONDITIONS:
                print(f"{kind:8s} {n:10s} {c}: per-round medians "
                      + " ".join(f"{row[kind][n][c]:.1f}" for row in result["rounds"]))
    print("clean rounds (others < 10% in the idle window):", result["clean_rounds"])
    for kind in ("decode", "prefill"):
        for n, per in result["clean_summary"][kind].items():
            if per["idle"] is None:
                continue
            print(f"clean {kind:8s} {n:10s} " + "  ".join(
                f"{c}: median {per[c]['median_ms']:.1f} worst {per[c]['worst_ms']:.1f}" for c in CONDITIONS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
