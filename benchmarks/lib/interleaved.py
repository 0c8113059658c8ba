"""offgraph-kv programs that differ only in max_capacity, decoded side by side in one process.

    python -m benchmarks.lib.interleaved --artifact 512=W/offgraph_512.pte --artifact 32768=W/offgraph_32768.pte \
        --contexts 200,2000 --out r.json

Programs measured one after another, each in its own process (``measure.py``),
meet different noise on a shared VM: a burst of other work can cover a whole
measuring window of one program and none of the next. Here every program is
loaded into one process and filled to the same context by prefill chunks; then
they take turns, ``window`` decode steps at a time, ``turns`` times each, so a
burst lands on all of them alike. Reported per context and capacity: the median
of all of that program's steps, and the medians of each turn.
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

# Thread counts must be fixed before torch (OpenMP) starts.
if __name__ == "__main__":
    _t = next((sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == "--threads"), None)
    if _t:
        os.environ["OMP_NUM_THREADS"] = _t

import torch  # noqa: E402

from benchmarks.lib.measure import OffGraphProgram, token_ids  # noqa: E402


def fill(prog: OffGraphProgram, context: int, vocab: int) -> None:
    """Empty the cache, then prefill ``context`` tokens in chunks of the program's widest step."""
    prog.reset()
    ids = token_ids(context, vocab, seed=7).view(1, -1)
    start = 0
    while start < context:
        w = min(prog.max_width, context - start)
        prog.step(ids[:, start:start + w], start)
        start += w


def interleaved_decode(programs: Dict[int, OffGraphProgram], contexts: List[int], window: int, turns: int,
                       vocab: int) -> Dict[str, Dict[str, object]]:
    out: Dict[str, Dict[str, object]] = {}
    steps = window * turns
    for ctx in contexts:
        fit = {c: p for c, p in programs.items() if c >= ctx + steps}
        if len(fit) < 2:
            continue
        for p in fit.values():
            fill(p, ctx, vocab)
        pos = {c: ctx for c in fit}
        times: Dict[int, List[float]] = {c: [] for c in fit}
        turn_medians: Dict[int, List[float]] = {c: [] for c in fit}
        ids = token_ids(steps, vocab, seed=11)
        for turn in range(turns):
            for c, p in fit.items():
                mine = []
                for k in range(window):
                    t0 = time.perf_counter()
                    p.step(ids[turn * window + k].view(1, 1), pos[c])
                    mine.append(time.perf_counter() - t0)
                    pos[c] += 1
                times[c] += mine
                turn_medians[c].append(statistics.median(mine) * 1e3)
        out[str(ctx)] = {
            "median_ms": {str(c): statistics.median(t) * 1e3 for c, t in times.items()},
            "turn_median_ms": {str(c): [round(x, 4) for x in v] for c, v in turn_medians.items()},
            "capacity_after": {str(c): p.metrics()["capacity"] for c, p in fit.items()},
        }
    return out


def greedy_turns(methods: Dict[str, object], context: int, steps: int, vocab: int = 49_152,
                 chunk: int = 64) -> "tuple[Dict[str, torch.Tensor], Dict[str, List[float]], Dict[str, List[int]]]":
    """Loaded methods (``execute([tokens, positions])``) filled with one random prompt of ``context``
    tokens in ``chunk``-token steps, then ``steps`` greedy decode steps each, in turns (a burst of other
    work lands on all alike). Returns each method's last prefill logits, decode step seconds and ids."""
    prompt = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0))
    last: Dict[str, torch.Tensor] = {}
    for k, m in methods.items():
        for s in range(0, context, chunk):
            w = min(chunk, context - s)
            last[k] = m.execute([prompt[:, s:s + w], torch.arange(s, s + w).unsqueeze(-1)])[0][:, -1]
    tok = {k: last[k].argmax(-1).view(1, 1) for k in methods}
    times: Dict[str, List[float]] = {k: [] for k in methods}
    ids: Dict[str, List[int]] = {k: [] for k in methods}
    for i in range(steps):
        for k, m in methods.items():
            t0 = time.perf_counter()
            out = m.execute([tok[k], torch.tensor([[context + i]])])[0]
            times[k].append(time.perf_counter() - t0)
            tok[k] = out[:, -1:].argmax(-1)
            ids[k].append(int(tok[k]))
    return last, times, ids


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", action="append", required=True, help="CAPACITY=PATH of an offgraph-kv .pte")
    p.add_argument("--contexts", default="200,2000")
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--max-write", type=int, default=512)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    programs = {}
    for spec in a.artifact:
        cap, path = spec.split("=", 1)
        programs[int(cap)] = OffGraphProgram(path, int(cap), a.max_write)
    result = {"window": a.window, "turns": a.turns, "threads": a.threads,
              "contexts": interleaved_decode(programs, [int(c) for c in a.contexts.split(",")], a.window, a.turns,
                                             a.vocab)}
    Path(a.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
