"""Measure one program in a fresh process: load RSS, decode per-step times, prefill.

    python -m benchmarks.lib.measure --kind offgraph --artifact W/offgraph_8192.pte --capacity 8192 --out r.json

One process per program keeps RSS clean: every kind imports the same modules
before the "before load" reading, so the RSS added by load is the program's own
(weights, code, planned buffers, KV storage). The protocol, the same for all:

1. load; RSS before / after.
2. decode one token per step from position 0 up to ``min(capacity, decode_to)``,
   ``passes`` times from an empty cache (memory read in the first pass; decode
   time at a context = the smallest of the passes' medians);
   the token ids are a fixed pseudo-random sequence (identical inputs for every
   program); per-step wall time around the execute call only; RSS sampled every
   64 steps and after 200 and 2000 tokens; offgraph store metrics after every
   step (outside the timed call) to find the steps that grew storage.
3. prefill a 512-token prompt from an empty cache, chunked to the program's
   widest step, ``repeats`` times (median tokens/s). The offgraph store is
   reset with its memory released first, so prefill includes its growths.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

# Thread counts must be fixed before torch (OpenMP) starts.
if __name__ == "__main__":
    _t = next((sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == "--threads"), None)
    if _t:
        os.environ["OMP_NUM_THREADS"] = _t

import torch  # noqa: E402

import executorch.extension.llm.custom_ops.custom_ops  # noqa: E402,F401  (stock export's sdpa kernels)
from executorch.runtime import Runtime  # noqa: E402

import offgraph_kv.runtime as ogr  # noqa: E402

from benchmarks.lib.machine import Contention, rss_mib  # noqa: E402
from benchmarks.lib.step_times import growth_share, median_ms  # noqa: E402

from benchmarks.lib.paths import use_example_model  # noqa: E402

use_example_model()
from model import positions  # noqa: E402

RSS_MARKS = (200, 2000)
CONTEXTS = (200, 2000, 4000)  # decode ms/token reported at these contexts (median of `window` steps)
PROMPT_TOKENS = 512
CHECK_STEPS = (0, 199, 511, 1999)  # logits saved here to check that all programs compute the same model


class Program:
    """``step(tokens [1, T], start) -> last-position logits [vocab]`` over one loaded program."""

    max_width: int

    def step(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        raise NotImplementedError

    def reset(self) -> None:
        """Forget the context (static caches need nothing: positions are overwritten, the mask hides the rest)."""

    def metrics(self) -> Optional[Dict[str, object]]:
        return None


class StockProgram(Program):
    def __init__(self, path: str, capacity: int) -> None:
        self.method = Runtime.get().load_program(path).load_method("forward")
        # The first input is tokens [1, max_seq_length - 1] (dynamic).
        meta = self.method.metadata.input_tensor_meta(0)
        self.max_width = int(meta.sizes()[1])

    def step(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        return self.method.execute([tokens, torch.tensor([start], dtype=torch.long)])[0].reshape(-1)


class StaticProgram(Program):
    def __init__(self, path: str, capacity: int, max_width: int) -> None:
        self.runner = torch._C._aoti.AOTIModelContainerRunnerCpu(path, 1)
        self.max_width = max_width

    def step(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        return self.runner.run([tokens, positions(start, tokens.shape[1])])[0][0, -1]


class OffGraphProgram(Program):
    def __init__(self, path: str, capacity: int, max_width: int) -> None:
        self.method = Runtime.get().load_program(path).load_method("forward")
        self.store = ogr.stores()[-1]
        self.max_width = max_width

    def step(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        return self.method.execute([tokens, positions(start, tokens.shape[1])])[0][0, -1]

    def reset(self) -> None:
        self.store.reset(release_memory=True)

    def metrics(self) -> Optional[Dict[str, object]]:
        m = dict(self.store.metrics())
        m.pop("layers", None)
        return m


def token_ids(n: int, vocab: int, seed: int = 1234) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.long)


def load(kind: str, path: str, capacity: int, max_write: int) -> Program:
    if kind == "stock":
        return StockProgram(path, capacity)
    if kind.startswith("static-"):
        return StaticProgram(path, capacity, max_write)
    return OffGraphProgram(path, capacity, max_write)


def decode(prog: Program, n: int, vocab: int, window: int, passes: int, rss0: float,
           rss_load: float) -> Dict[str, object]:
    """``passes`` decode passes of ``n`` one-token steps from an empty cache: times, memory, growths, check logits."""
    # `passes` decode passes from an empty cache; memory is read in the first, and
    # the decode time at each context is the smallest of the passes' medians (noise
    # on a shared VM only ever adds time, in bursts that can cover a whole window).
    result: Dict[str, object] = {}
    ids = token_ids(n, vocab)
    pass_times: List[List[float]] = []
    rss_trace: List[List[float]] = [[0, rss_load - rss0]]
    rss_at: Dict[str, float] = {}
    alloc_trace: List[List[int]] = []
    metrics_at: Dict[str, object] = {}
    checks: Dict[str, List[float]] = {}
    growth: List[Dict[str, object]] = []
    busy: List[Optional[float]] = []
    for p in range(passes):
        if p:
            prog.reset()
        first = p == 0
        times: List[float] = []
        grew: List[bool] = []
        cap_prev = (prog.metrics() or {}).get("capacity")
        contention = Contention()
        for i in range(n):
            # A view per step, made here: a list of n views made up front costs ~0.5 KiB
            # each, so RSS at 200 tokens grew with how far a program was going to decode.
            x = ids[i].view(1, 1)
            t = time.perf_counter()
            logits = prog.step(x, i)
            times.append(time.perf_counter() - t)
            done = i + 1
            m = prog.metrics()
            if m is not None:
                grew.append(m["capacity"] != cap_prev)
                cap_prev = m["capacity"]
                if first and (done % 64 == 0 or done in RSS_MARKS or grew[-1]):
                    alloc_trace.append([done, m["allocated_bytes"], m["peak_bytes"], m["capacity"]])
            if not first:
                continue
            if i in CHECK_STEPS:
                checks[str(i)] = logits.detach().float().tolist()
            if done % 64 == 0 or done in RSS_MARKS or done == n:
                r = rss_mib() - rss0
                rss_trace.append([done, r])
                if done in RSS_MARKS:
                    rss_at[str(done)] = r
                    if m is not None:
                        metrics_at[str(done)] = m
        busy.append(contention.others_fraction())
        pass_times.append(times)
        if grew:
            growth.append(growth_share(times, grew))
        if first:
            result["metrics_after_decode"] = prog.metrics()
    busy_known = [b for b in busy if b is not None]
    result["decode_others_busy"] = max(busy_known) if busy_known else None
    result["decode_others_busy_per_pass"] = busy
    result["decoded_tokens"] = n
    result["decode_passes"] = passes
    per_pass = [{str(c): median_ms(t, c, window) for c in CONTEXTS} for t in pass_times]
    result["decode_ms_per_pass"] = per_pass
    result["decode_ms"] = {str(c): (min(v) if (v := [pp[str(c)] for pp in per_pass if pp[str(c)] is not None])
                                    else None) for c in CONTEXTS}
    result["decode_window"] = window
    result["rss_at_tokens_mib"] = rss_at
    result["rss_trace_mib"] = rss_trace
    result["metrics_at_tokens"] = metrics_at
    if growth:
        shares = [g["growth_time_share"] for g in growth if g["growth_time_share"] is not None]
        result["growth"] = dict(growth[0], growth_time_share_per_pass=shares,
                                growth_time_share=statistics.median(shares) if shares else None)
        result["alloc_trace"] = alloc_trace
    # Per step: the smallest time over the passes (plots take bucket medians of it).
    result["step_ms"] = [round(min(ts) * 1e3, 4) for ts in zip(*pass_times)]
    result["check_logits"] = checks
    return result


def prefill(prog: Program, vocab: int, repeats: int) -> Dict[str, object]:
    """A ``PROMPT_TOKENS`` prompt from an empty cache, in chunks of the program's widest step, ``repeats`` times."""
    prompt = token_ids(PROMPT_TOKENS, vocab, seed=99).view(1, -1)
    chunks = []
    start = 0
    while start < PROMPT_TOKENS:
        w = min(prog.max_width, PROMPT_TOKENS - start)
        chunks.append((start, w))
        start += w
    runs = []
    growths = []
    contention = Contention()
    for _ in range(repeats):
        prog.reset()
        g0 = (prog.metrics() or {}).get("growths")
        t = time.perf_counter()
        for s, w in chunks:
            prog.step(prompt[:, s:s + w], s)
        runs.append(time.perf_counter() - t)
        if g0 is not None:
            growths.append(prog.metrics()["growths"] - g0)
    return {
        "tokens": PROMPT_TOKENS, "chunks": [w for _, w in chunks], "repeats": repeats,
        "median_s": statistics.median(runs), "tokens_per_s": PROMPT_TOKENS / statistics.median(runs),
        "all_s": runs, "growths_per_prefill": growths or None, "others_busy": contention.others_fraction(),
    }


def measure(kind: str, path: str, capacity: int, max_write: int, decode_to: int, repeats: int,
            window: int, vocab: int, threads: int, passes: int = 3) -> Dict[str, object]:
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    torch.set_num_threads(threads)
    _unsafe_reset_threadpool(threads)  # XNNPACK's pool, used by the stock program
    torch.manual_seed(0)
    result: Dict[str, object] = {"kind": kind, "capacity": capacity, "artifact_bytes": os.path.getsize(path),
                                 "threads": threads}

    rss0 = rss_mib()
    t0 = time.perf_counter()
    prog = load(kind, path, capacity, max_write)
    result["load_s"] = time.perf_counter() - t0
    rss_load = rss_mib()
    result["rss_before_load_mib"] = rss0
    result["rss_load_mib"] = rss_load - rss0
    result["max_width"] = prog.max_width
    result["metrics_after_load"] = prog.metrics()

    result.update(decode(prog, min(capacity, decode_to), vocab, window, passes, rss0, rss_load))
    if PROMPT_TOKENS <= capacity:
        result["prefill"] = prefill(prog, vocab, repeats)
    result["rss_end_mib"] = rss_mib() - rss0
    result["metrics_end"] = prog.metrics()
    return result


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", required=True)
    p.add_argument("--artifact", required=True)
    p.add_argument("--capacity", type=int, required=True)
    p.add_argument("--max-write", type=int, default=512)
    p.add_argument("--decode-to", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--window", type=int, default=50)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    r = measure(a.kind, a.artifact, a.capacity, a.max_write, a.decode_to, a.repeats, a.window, a.vocab, a.threads, a.passes)
    Path(a.out).write_text(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
