"""CPU decode over 16-bit KV: the history attended as stored against converted
to fp32 every step, two programs of one model stepped in turns in one process.

    OFFGRAPH_KV_CPU_ATTENTION=convert python examples/llama/export.py --out convert.pte
    python examples/llama/export.py --out direct.pte
    python -m benchmarks.cpu.attention_16bit --program convert=convert.pte --program direct=direct.pte \
        --contexts 200,2000 --out benchmarks/results/cpu_attention_16bit.json

Both programs are filled with the same tokens to each context; then, for
``--turns`` turns, each takes ``--window`` decode steps (the same tokens),
timed one by one, and is rewound to the context, so every step of both sees
the same history, and a burst of other work on the machine lands on both
alike (programs alternate which goes first). Reported per context: each
program's median and worst step, the ratio of medians, and how far the two
programs' logits are apart on those steps (they compute the same model).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

import offgraph_kv.runtime as ogr
from executorch.runtime import Runtime

from benchmarks.lib.machine import Contention, describe, now_utc


def positions(start: int, width: int) -> torch.Tensor:
    # The Llama example's input_pos: [T, 1] int64 (examples/llama/model.py).
    return torch.arange(start, start + width, dtype=torch.long).view(width, 1)


class Program:
    def __init__(self, path: str) -> None:
        self.method = Runtime.get().load_program(path).load_method("forward")
        self.store = ogr.stores()[-1]

    def step(self, tokens: torch.Tensor) -> "tuple[float, torch.Tensor]":
        start = self.store.length
        t = time.perf_counter()
        out = self.method.execute([tokens, positions(start, tokens.shape[1])])[0]
        return time.perf_counter() - t, out

    def fill(self, ids: torch.Tensor, chunk: int) -> None:
        self.store.reset()
        at = 0
        while at < ids.numel():
            w = min(chunk, ids.numel() - at)
            self.step(ids[at:at + w].view(1, -1))
            at += w


def run(programs: Dict[str, str], contexts: List[int], window: int, turns: int, chunk: int,
        vocab: int) -> Dict[str, object]:
    loaded = {name: Program(path) for name, path in programs.items()}
    names = list(loaded)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (max(contexts),), generator=g)
    steps = torch.randint(0, vocab, (window,), generator=g)
    out: Dict[str, object] = {}
    for ctx in contexts:
        for p in loaded.values():
            p.fill(ids[:ctx], chunk)
        times: Dict[str, List[float]] = {n: [] for n in names}
        turn_medians: Dict[str, List[float]] = {n: [] for n in names}
        logits: Dict[str, List[torch.Tensor]] = {n: [] for n in names}
        watch = Contention()
        for turn in range(turns):
            for name in (names if turn % 2 == 0 else names[::-1]):
                p = loaded[name]
                mine = []
                for k in range(window):
                    dt, o = p.step(steps[k].view(1, 1))
                    mine.append(dt * 1e3)
                    if turn == 0:
                        logits[name].append(o[0, -1].float().clone())
                p.store.rewind(window)
                times[name] += mine
                turn_medians[name].append(statistics.median(mine))
        diff = max((a - b).abs().max().item() for a, b in zip(logits[names[0]], logits[names[1]]))
        same_argmax = sum(int(a.argmax() == b.argmax()) for a, b in zip(logits[names[0]], logits[names[1]]))
        med = {n: statistics.median(t) for n, t in times.items()}
        out[str(ctx)] = {
            "median_ms": med, "worst_ms": {n: max(t) for n, t in times.items()},
            "turn_median_ms": {n: [round(x, 3) for x in v] for n, v in turn_medians.items()},
            f"ratio_{names[1]}_over_{names[0]}": med[names[1]] / med[names[0]],
            "max_abs_logit_diff": diff, "same_argmax": f"{same_argmax}/{len(logits[names[0]])}",
            "others_busy": watch.others_fraction(),
        }
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--program", action="append", required=True, help="NAME=PATH; two of them (baseline first)")
    p.add_argument("--contexts", default="200,2000")
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    programs = dict(spec.split("=", 1) for spec in a.program)
    if len(programs) != 2:
        p.error("two --program NAME=PATH, the baseline first")
    torch.set_num_threads(1)  # the runtime's default for decode steps either way; the host's torch stays out of it
    started, t0 = now_utc(), time.perf_counter()
    result = {"contexts": run(programs, [int(c) for c in a.contexts.split(",")], a.window, a.turns, a.chunk, a.vocab),
              "programs": programs, "window": a.window, "turns": a.turns, "machine": describe(),
              "started_utc": started, "seconds": time.perf_counter() - t0,
              "command": " ".join(["python", "-m", "benchmarks.cpu.attention_16bit"] + (argv or sys.argv[1:]))}
    Path(a.out).write_text(json.dumps(result, indent=1))
    for ctx, r in result["contexts"].items():
        print(f"context {ctx}: " + "  ".join(f"{n} median {r['median_ms'][n]:.2f} ms (worst {r['worst_ms'][n]:.1f})"
                                             for n in programs)
              + f"  ratio {[v for k, v in r.items() if k.startswith('ratio_')][0]:.3f}"
              + f"  max |dlogit| {r['max_abs_logit_diff']:.2e}, argmax same {r['same_argmax']}"
              + f"  others busy {r['others_busy']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
