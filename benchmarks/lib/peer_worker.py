"""One program of the peer benchmark, loaded in a process of its own and driven by the parent.

    python -m benchmarks.lib.peer_worker --kind offgraph --path W/smollm2_bf16-bf16.pte            # serve
    python -m benchmarks.lib.peer_worker --kind llamacpp --path W/smollm2_Q8_0.gguf --sample-text  # a chat answer

Kinds: ``offgraph`` (an offgraph-kv .pte), ``xnnpack`` (stock ExecuTorch's
export_llama .pte: static KV cache, XNNPACK) and ``llamacpp`` (a GGUF through
llama-cpp-python). Every kind imports the same modules (torch, the ExecuTorch
runtime, offgraph-kv's runtime, llama_cpp) before the "before load" RSS
reading, so the RSS a load adds is the program's own.

Serving: the parent writes one JSON command a line on stdin; the worker
answers one line on stdout that starts with ``@@`` (libraries may print other
lines). It answers ``{"ready": true}`` once its imports are done, so the
parent can start every worker at once and still load them one at a time.
Only one worker computes at a time, so programs take turns round by round in
one run and meet the same machine. Commands:

- ``{"cmd": "load", "warm_up": true}``: load the program (its file already in
  the page cache); load time, RSS added;
- ``{"cmd": "decode", "contexts": [200, 2000], "steps": 40, "busy_procs": 2}``:
  from an empty cache, prefill the fixed prompt ids up to each context, then
  ``steps`` greedy decode steps (next token = argmax of the logits) on the
  idle machine, and the same steps again, rewound to the context, with
  ``busy_procs`` spinning processes (which goes first alternates with
  ``busy_first``); the wall time of each step's forward call only;
- ``{"cmd": "prefill", "tokens": 512}``: from an empty cache, the prompt in
  the program's widest calls, timed as a whole;
- ``{"cmd": "rss"}``; ``{"cmd": "quit"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

# One compute thread unless told otherwise; OpenMP reads this once, before torch or ggml start.
if __name__ == "__main__":
    _t = next((sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == "--threads"), "1")
    os.environ["OMP_NUM_THREADS"] = _t

import torch  # noqa: E402

import executorch.extension.llm.custom_ops.custom_ops  # noqa: E402,F401  (the stock export's sdpa kernels)

import offgraph_kv.runtime  # noqa: E402,F401  (registers the delegate)

from benchmarks.lib.machine import Busy, Contention, rss_mib  # noqa: E402
from benchmarks.lib.measure import OffGraphProgram, Program, StockProgram, token_ids  # noqa: E402

try:  # optional peer: its absence only rules out the llamacpp kind
    import llama_cpp  # noqa: F401
except ImportError:  # pragma: no cover - reported by the parent
    llama_cpp = None

MARK = "@@"
VOCAB = 49_152
LLAMACPP_CONTEXT = 2048  # llama.cpp's KV cache rows: the stock program's static capacity, 2,040 tokens needed
LLAMACPP_BATCH = 512  # llama.cpp's default n_batch: a 512-token prompt is one call
OFFGRAPH_MAX_WRITE = 64  # export.py's default (the .pte's widest step)


def peak_rss_mib() -> float:
    """The process's peak resident set (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("VmHWM not found in /proc/self/status")


class LlamaCppProgram(Program):
    """A GGUF through llama-cpp-python's ``Llama``: ``eval`` appends tokens at ``n_tokens``
    (dropping any cache rows past it), so a step at ``start`` first moves ``n_tokens`` there."""

    def __init__(self, path: str, threads: int) -> None:
        if llama_cpp is None:
            raise ImportError("llama_cpp is not installed (pip install llama-cpp-python)")
        # Defaults a user gets (mmap, f16 KV cache), one compute thread for decode and for prompts.
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=LLAMACPP_CONTEXT, n_batch=LLAMACPP_BATCH,
                                   n_ubatch=LLAMACPP_BATCH, n_threads=threads, n_threads_batch=threads,
                                   verbose=False)
        self.max_width = LLAMACPP_BATCH
        self.n_vocab = self.llm.n_vocab()

    def step(self, tokens: torch.Tensor, start: int) -> "object":
        import numpy as np

        self.llm.n_tokens = start
        self.llm.eval(tokens.reshape(-1).tolist())
        # ``eval`` keeps no logits unless every position's are asked for (logits_all), so read the
        # last position's from the context, as llama.cpp's own samplers do (a view, read before the next step).
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,))

    def reset(self) -> None:
        self.llm.reset()


def load(kind: str, path: str, threads: int) -> Program:
    if kind == "offgraph":
        return OffGraphProgram(path, 0, OFFGRAPH_MAX_WRITE)
    if kind == "xnnpack":
        return StockProgram(path, 0)
    if kind == "llamacpp":
        return LlamaCppProgram(path, threads)
    raise ValueError(f"unknown kind {kind!r}; expected offgraph, xnnpack or llamacpp")


def argmax(logits: "object") -> int:
    if isinstance(logits, torch.Tensor):
        return int(torch.argmax(logits))
    return int(logits.argmax())  # numpy (llama.cpp's logits)


def fill(prog: Program, ids: torch.Tensor, start: int, end: int) -> "object":
    """Prefill ``ids[start:end]`` at positions ``start..end-1`` in the program's widest calls; last logits."""
    logits = None
    while start < end:
        w = min(prog.max_width, end - start)
        logits = prog.step(ids[start:start + w].view(1, -1), start)
        start += w
    return logits


def rewind(prog: Program, to: int, pos: int) -> None:
    """Forget positions ``to..pos-1``: offgraph-kv's store drops them; llama.cpp drops them itself at the
    next step (``n_tokens`` moves back); the static cache is overwritten, its op masks by position."""
    if isinstance(prog, OffGraphProgram) and pos > to:
        prog.store.rewind(pos - to)


def decode(prog: Program, contexts: Sequence[int], steps: int, busy_procs: int, busy_first: bool) -> \
        Dict[str, Dict[str, object]]:
    """Greedy decode ``steps`` tokens at each context (filled with the fixed prompt ids up to it), idle and
    with ``busy_procs`` spinning processes: one fill serves both windows, the second rewound to the same
    context and logits, so both decode the same tokens at the same positions (and 2,000 + steps fits 2,048)."""
    ids = token_ids(max(contexts), VOCAB, seed=1234)
    prog.reset()
    pos = 0
    out: Dict[str, Dict[str, object]] = {}
    for ctx in sorted(contexts):
        filled = fill(prog, ids, pos, ctx)
        if not isinstance(filled, torch.Tensor):
            filled = filled.copy()  # llama.cpp's logits are a view of its buffer, rewritten by the next step
        pos = ctx
        out[str(ctx)] = {}
        for cond in (("busy", "idle") if busy_first else ("idle", "busy")):
            rewind(prog, ctx, pos)
            pos, logits = ctx, filled
            times: List[float] = []
            generated: List[int] = []
            with Busy(busy_procs if cond == "busy" else 0):
                for _ in range(steps):
                    nxt = argmax(logits)
                    generated.append(nxt)
                    x = torch.tensor([[nxt]], dtype=torch.long)
                    t = time.perf_counter()
                    logits = prog.step(x, pos)
                    times.append(time.perf_counter() - t)
                    pos += 1
            out[str(ctx)][cond] = {"step_ms": [round(s * 1e3, 4) for s in times], "ids": generated}
    return out


def prefill(prog: Program, tokens: int) -> Dict[str, object]:
    ids = token_ids(tokens, VOCAB, seed=99)
    prog.reset()
    contention = Contention()  # measured here: this process's own CPU time is not "others"
    t = time.perf_counter()
    fill(prog, ids, 0, tokens)
    took = time.perf_counter() - t
    return {"tokens": tokens, "s": took, "tokens_per_s": tokens / took, "width": prog.max_width,
            "others_busy": contention.others_fraction()}


def warm_up(prog: Program) -> None:
    """One short prompt and a few steps: first-touch costs (mmap'd weights, lazy setup) are not a step's."""
    ids = token_ids(64, VOCAB, seed=5)
    prog.reset()
    fill(prog, ids, 0, 60)
    for i in range(4):
        prog.step(ids[60 + i:61 + i].view(1, 1), 60 + i)
    prog.reset()


def setup_threads(threads: int) -> None:
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    torch.set_num_threads(threads)
    _unsafe_reset_threadpool(threads)  # XNNPACK's pool (the stock program)


def loaded(kind: str, path: str, threads: int) -> "tuple[Program, Dict[str, object]]":
    setup_threads(threads)
    rss0, hwm0 = rss_mib(), peak_rss_mib()
    t = time.perf_counter()
    prog = load(kind, path, threads)
    load_s = time.perf_counter() - t
    info: Dict[str, object] = {"load_s": load_s, "rss_before_load_mib": rss0, "peak_before_load_mib": hwm0,
                               "rss_load_mib": rss_mib() - rss0, "max_width": prog.max_width}
    return prog, info


def sample_text(kind: str, path: str, threads: int, prompt: str, max_tokens: int) -> Dict[str, object]:
    """A greedy chat answer, to see that a written file is the model (llama.cpp's files)."""
    if kind != "llamacpp":
        raise ValueError("--sample-text reads GGUF files (kind llamacpp)")
    prog = LlamaCppProgram(path, threads)
    r = prog.llm.create_chat_completion(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                        temperature=0.0, top_k=1)
    return {"prompt": prompt, "text": r["choices"][0]["message"]["content"]}


def serve(kind: str, path: str, threads: int) -> None:
    def answer(obj: Dict[str, object]) -> None:
        sys.stdout.write(f"{MARK} {json.dumps(obj)}\n")
        sys.stdout.flush()

    answer({"ready": True})
    prog: Optional[Program] = None
    info: Dict[str, object] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        what = cmd["cmd"]
        if what == "quit":
            answer({"bye": True})
            return
        if what == "load":
            prog, info = loaded(kind, path, threads)
            if cmd.get("warm_up", True):
                warm_up(prog)
                info["rss_after_warm_up_mib"] = rss_mib() - info["rss_before_load_mib"]
            answer(info)
        elif prog is None:
            answer({"error": f"{what!r} before load"})
        elif what == "decode":
            answer(decode(prog, cmd["contexts"], cmd["steps"], cmd.get("busy_procs", 0), cmd.get("busy_first", False)))
        elif what == "prefill":
            answer(prefill(prog, cmd["tokens"]))
        elif what == "rss":
            m = prog.metrics()
            answer({"rss_mib": rss_mib() - info["rss_before_load_mib"],
                    "peak_rss_mib": peak_rss_mib() - info["rss_before_load_mib"],
                    "store": None if m is None else {k: m.get(k) for k in ("allocated_bytes", "peak_bytes",
                                                                           "capacity", "reserved_bytes")}})
        else:
            answer({"error": f"unknown command {what!r}"})


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", required=True, choices=["offgraph", "xnnpack", "llamacpp"])
    p.add_argument("--path", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sample-text", action="store_true", help="print a greedy chat answer and exit")
    p.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    p.add_argument("--max-tokens", type=int, default=32)
    a = p.parse_args(argv)
    if a.sample_text:
        print(f"{MARK} {json.dumps(sample_text(a.kind, a.path, a.threads, a.prompt, a.max_tokens))}", flush=True)
        return 0
    serve(a.kind, a.path, a.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
