"""A long life on the GPU: one greedy generation to 100 000 tokens with growths.

    python -m benchmarks.cuda.long_run --workdir /tmp/long --out benchmarks/results/long_run_h200.json [--tokens 100000]
        [--chunk 512 --tail 1000] [--build-only | --reuse]

Every token is a decode step by default. ``--chunk N`` spends less time: after
the oracle-checked decode steps the context grows ``N`` tokens a step (the
generated token fed N times would be a degenerate prompt, so a fixed
pseudo-random chunk is fed instead) until ``--tail`` tokens are left, which are
decoded one at a time again.

The 16-layer variant of the CUDA suite's model (Llama-3-8B attention shapes, bf16
weights and KV, random weights; ``benchmarks/cuda/suite.py``), exported with
max_capacity 131 072 and initial capacity 256 (doubling: 9 growths to 131 072).
Checked: no step fails; the first 200 tokens' logits against the eager model over
ExecuTorch's reference cache, teacher-forced on the same tokens (greedy tokens
equal, logits close); the store's allocation and the device memory in use
follow the context (sampled at every power-of-two context and the end).
``--small`` runs a 2-layer model on CPU for a dry run of the script.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

from benchmarks.lib.cuda_model import SHAPE, SMALL, Runner, build, device_used
from benchmarks.lib.report import save

ORACLE_STEPS = 200


def oracle_logits(shape: Dict[str, int], tokens: List[int]) -> torch.Tensor:
    """The eager model over ExecuTorch's reference cache, fed ``tokens`` one at a time, on CPU:
    the reference cache keeps its history on the CPU (as the tests' oracle does)."""
    from executorch.extension.llm.cache.reference_cache import CacheConfig, ContiguousReferenceCache, LayerPolicy
    from executorch.extension.llm.cache.update_and_attend import REGISTRY
    from model import ModelArgs, Transformer, init_deterministic, positions

    model = init_deterministic(Transformer(ModelArgs(**shape)), seed=0).to(torch.bfloat16).eval()
    a = model.args
    cache = ContiguousReferenceCache(CacheConfig(n_layers=a.n_layers, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                                                 capacity=len(tokens) + 1, dtype=torch.bfloat16,
                                                 layers=(LayerPolicy.flat(),)))
    REGISTRY.install("long_run_oracle", cache)
    out = []
    with REGISTRY.active("long_run_oracle"), torch.no_grad():
        for i, t in enumerate(tokens):
            out.append(model(torch.tensor([[t]]), positions(i, 1))[0, -1].float())
    return torch.stack(out)


def model_shape(small: bool) -> Dict[str, int]:
    """The CUDA suite's model with 16 layers, or its 2-layer small variant."""
    return dict(SMALL) if small else dict(SHAPE, n_layers=16)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of bfloat16 at |x| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0**-126))) - 7)


def compare_with_oracle(shape: Dict[str, int], fed: List[int], chosen: List[int],
                        ours: "torch.Tensor | None" = None) -> Dict[str, object]:
    """Our greedy choices against the oracle's logits, teacher-forced on the tokens we fed.

    The oracle's logits are bfloat16, so two tokens can tie exactly or within one
    bf16 step; a choice is accepted if it is the oracle's argmax or within one
    bf16 ulp of it (counted apart as ``ties``), never silently."""
    want = oracle_logits(shape, fed)
    best = want.argmax(-1)
    pick = torch.tensor(chosen)
    margin = want.gather(1, best[:, None])[:, 0] - want.gather(1, pick[:, None])[:, 0]
    equal = best == pick
    tied = ~equal & (margin <= bf16_ulp(want.gather(1, best[:, None])[:, 0]))
    out: Dict[str, object] = {
        "steps": len(fed), "greedy_equal": int(equal.sum()), "ties": int(tied.sum()),
        "greedy_equal_or_tied": int((equal | tied).sum()),
        "first_difference": int((~equal).nonzero()[0]) if not bool(equal.all()) else None,
        "largest_margin_passed_over": float(margin[~equal].max()) if not bool(equal.all()) else 0.0,
        "tokens": fed}
    if ours is not None:
        out["max_abs_logit_diff"] = float((ours - want).abs().max())
    return out


def recheck(path: Path, shape: Dict[str, int]) -> Dict[str, object]:
    """The oracle comparison again from a result file's recorded tokens (each step's choice is the
    next token fed), e.g. with this machine's CPU oracle for a run made elsewhere."""
    fed = json.loads(path.read_text())["oracle"]["tokens"]
    return compare_with_oracle(shape, fed[:-1], fed[1:])


def run(args: argparse.Namespace) -> Dict[str, object]:
    from tqdm import tqdm

    from benchmarks.lib.machine import describe

    shape = model_shape(args.small)
    device = "cpu" if args.small else "cuda"
    args.workdir.mkdir(parents=True, exist_ok=True)
    pte = args.workdir / "long_run.pte"
    result: Dict[str, object] = {"machine": describe(), "shape": shape, "tokens": args.tokens}
    if args.reuse and pte.exists():  # a program this script built earlier in the same workdir
        result["build"] = {"path": str(pte), "bytes": pte.stat().st_size, "reused": True}
    else:
        result["build"] = build(shape, device, args.max_capacity, pte)
    if args.build_only:
        return result
    runner = Runner(pte)
    tok = torch.tensor([[1]], dtype=torch.long)
    tokens, logits_head, memory, failures = [], [], {}, []
    marks = {1 << k for k in range(8, 18)} | {args.tokens}
    t0 = time.perf_counter()
    chunk = torch.randint(0, shape["vocab_size"], (1, max(args.chunk, 1)), generator=torch.Generator().manual_seed(3))
    steps, length = 0, 0
    bar = tqdm(total=args.tokens, desc="generate", unit="tok", mininterval=10)
    while length < args.tokens:
        wide = args.chunk > 1 and ORACLE_STEPS <= length and length + args.chunk <= args.tokens - args.tail
        feed = chunk if wide else tok
        tokens.extend(int(t) for t in feed[0])
        try:
            logits = runner.step(feed)
        except RuntimeError as e:  # recorded, not hidden: the verdict fails
            failures.append({"step": steps, "length": length, "error": str(e)[:500]})
            break
        if length < ORACLE_STEPS:
            logits_head.append(logits[0, -1].float().cpu())
        tok = logits[:, -1:].argmax(-1).cpu()
        before, length, steps = length, length + feed.shape[1], steps + 1
        bar.update(feed.shape[1])
        if any(before < mark <= length for mark in marks):
            m = runner.store.metrics()
            memory[str(length)] = {"device_used": device_used(device), "kv_allocated": m["allocated_bytes"],
                                   "kv_peak": m["peak_bytes"], "capacity": m["capacity"], "growths": m["growths"],
                                   "graph_captures": m["graph_captures"], "graph_replays": m["graph_replays"],
                                   "elapsed_s": round(time.perf_counter() - t0, 1)}
            save(result | {"memory": memory, "failures": failures}, args.out)
    bar.close()
    result["steps"] = steps
    result["generate_s"] = time.perf_counter() - t0
    result["memory"], result["failures"] = memory, failures
    kv_per_token = 2 * shape["n_layers"] * shape["n_kv_heads"] * 128 * 2 if not args.small else None
    result["kv_bytes_per_token"] = kv_per_token
    del runner
    ours = torch.stack(logits_head)
    result["oracle"] = compare_with_oracle(shape, tokens[:len(logits_head)], ours.argmax(-1).tolist(), ours)
    ok = result["oracle"]["greedy_equal_or_tied"] == result["oracle"]["steps"]
    result["verdict"] = "PASS" if not failures and ok and length == args.tokens else "FAIL"
    return result


def plot(result_file: Path, path: Path) -> Path:
    """KV and device memory against the context, and the decode time per token between samples."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = json.loads(result_file.read_text())
    pts = sorted((int(k), v) for k, v in r["memory"].items())
    ctx = [c for c, _ in pts]
    fig, (mem, dec) = plt.subplots(1, 2, figsize=(11, 4))
    mem.plot(ctx, [m["kv_allocated"] / 2**30 for _, m in pts], "o-", label="KV allocated")
    if pts[0][1]["device_used"] is not None:
        mem.plot(ctx, [m["device_used"] / 2**30 for _, m in pts], "s-", label="device memory in use")
    mem.set(xscale="log", xlabel="context (tokens)", ylabel="GiB", title="memory follows the context")
    mem.legend()
    mid = [(a[0] + b[0]) / 2 for a, b in zip(pts, pts[1:])]
    ms = [1e3 * (b[1]["elapsed_s"] - a[1]["elapsed_s"]) / (b[0] - a[0]) for a, b in zip(pts, pts[1:])]
    dec.plot(mid, ms, "o-")
    dec.set(xscale="log", xlabel="context (tokens)", ylabel="ms / token",
            title="decode time per token between samples")
    fig.suptitle(f"{r['tokens']:,}-token generation, {r['shape']['n_layers']} layers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: "List[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/long_run"))
    p.add_argument("--out", default=None)
    p.add_argument("--tokens", type=int, default=100_000)
    p.add_argument("--max-capacity", type=int, default=131_072)
    p.add_argument("--chunk", type=int, default=0, help="tokens per step between the checked head and the tail")
    p.add_argument("--tail", type=int, default=1000, help="tokens decoded one at a time at the end (with --chunk)")
    p.add_argument("--small", action="store_true")
    p.add_argument("--reuse", action="store_true", help="use long_run.pte from --workdir if it is there")
    p.add_argument("--build-only", action="store_true", help="export long_run.pte into --workdir and stop")
    p.add_argument("--recheck", type=Path, help="redo the oracle comparison of a result file's recorded tokens")
    p.add_argument("--plot", type=Path, nargs=2, metavar=("RESULT", "PNG"), help="plot a result file and stop")
    a = p.parse_args(argv)
    if a.plot:
        print(plot(*a.plot))
        return 0
    if a.recheck:
        o = recheck(a.recheck, model_shape(a.small))
        print(json.dumps({k: v for k, v in o.items() if k != "tokens"}))
        return 0 if o["greedy_equal_or_tied"] == o["steps"] else 1
    r = run(a)
    if a.build_only:
        print(f"built {r['build']}")
        return 0
    save(r, a.out)
    o = r["oracle"]
    print(f"{r['verdict']}: {len(r['memory']) and max(int(k) for k in r['memory'])} tokens in {r['steps']} steps, "
          f"{r['generate_s']:.0f} s, "
          f"failures {len(r['failures'])}; oracle: {o['greedy_equal']}/{o['steps']} greedy tokens equal "
          f"(+{o['ties']} bf16 ties), "
          f"max |logit diff| {o['max_abs_logit_diff']:.3g}")
    for ctx, m in sorted(r["memory"].items(), key=lambda kv: int(kv[0])):
        used = f", device used {m['device_used'] / 2**30:.2f} GiB" if m["device_used"] is not None else ""
        print(f"  {int(ctx):>7} tokens: capacity {m['capacity']:>7}, KV {m['kv_allocated'] / 2**20:8.1f} MiB{used}, "
              f"{m['elapsed_s']} s")
    return 0 if r["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
