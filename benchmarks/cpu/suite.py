"""CPU benchmark: offgraph-kv against two static-KV baselines, same model and weights, one run.

    python -m benchmarks.cpu                 # full run (~10 min on 2 cores), writes benchmarks/results/cpu*
    python -m benchmarks.cpu --quick         # fewer capacities, shorter decode

Programs (the DESIGN's toy llama: dim 256, 4 layers, 8 query / 2 KV heads,
vocab 512, fp32 weights, fp32 KV):

- baseline 1, ``stock``: ExecuTorch's own llama export (``export_llama -kv
  --use_sdpa_with_kv_cache -X``), static KV cache of ``max_context_length`` rows,
  XNNPACK, from a Meta checkpoint of the same weights.
- baseline 2, ``static-mask``: the example llama through the same AOTInductor
  path as offgraph-kv, KV as in-graph static buffers of the full capacity,
  attention over the whole capacity with a causal mask (the honest static cache).
- baseline 2b, ``static-prefix``: as baseline 2 but attention over the used
  prefix only (best case for a static cache; memory is still the capacity).
- ``offgraph``: the example llama lowered with ``OffGraphKVPartitioner``
  (storage fp32, initial capacity 256, max capacity C).

Every program is built once (two builds at a time), then measured alone in a
fresh process (``measure.py``): RSS added by load and after 200 / 2000 tokens,
decode ms/token at context 200 / 2000 / 4000 (median of 50 steps), prefill
tokens/s for a 512-token prompt, offgraph growths and their time share. Then
the offgraph-kv programs of every capacity decode in turns in one process
(``interleaved.py``), which is what the capacity-independence target is judged
on. The run prints a table and PASS/FAIL per target (it does not assert) and writes
``cpu.json``, ``cpu_memory.png``, ``cpu_decode.png`` and ``cpu_summary.md``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from tqdm import tqdm

from benchmarks.lib import machine, report
from benchmarks.lib.paths import REPO, RESULTS

SUFFIX = {"stock": ".pte", "static-mask": ".so", "static-prefix": ".so", "offgraph": ".pte"}


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--capacities", type=_ints, default=[512, 8192],
                   help="capacities of the AOTI static baselines (and of offgraph-kv)")
    p.add_argument("--offgraph-capacities", type=_ints, default=None,
                   help="max capacities of the offgraph-kv lowerings (default: --capacities + 32768)")
    p.add_argument("--stock-capacities", type=_ints, default=[512, 8192, 32768],
                   help="max_context_length of the stock ExecuTorch exports (empty: skip baseline 1)")
    p.add_argument("--decode-to", type=int, default=4096, help="decode steps per program (capped by its capacity)")
    p.add_argument("--window", type=int, default=50, help="steps per decode median")
    p.add_argument("--repeats", type=int, default=3, help="prefill repetitions (median)")
    p.add_argument("--passes", type=int, default=2, help="decode passes per process (min of the per-pass medians)")
    p.add_argument("--rounds", type=int, default=2,
                   help="fresh-process timing rounds per program (memory from round 1; times: min over rounds)")
    p.add_argument("--max-write", type=int, default=512, help="widest step of the exports (prefill chunk)")
    p.add_argument("--threads", type=int, default=1,
                   help="compute threads of every program (OpenMP and XNNPACK); 1 keeps medians stable when "
                        "other processes share the cores")
    p.add_argument("--jobs", type=int, default=2, help="builds run at the same time")
    p.add_argument("--decode-tolerance", type=float, default=1.10,
                   help="max/min of offgraph decode ms across capacities that still counts as independent")
    p.add_argument("--rss-tolerance-mib", type=float, default=1.0)
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--workdir", help="where programs are built (default: a temporary directory, removed after)")
    p.add_argument("--keep", action="store_true", help="keep the workdir")
    p.add_argument("--quick", action="store_true", help="capacities 512/8192 only, decode to 2100")
    a = p.parse_args(argv)
    if a.quick:
        a.stock_capacities = [c for c in a.stock_capacities if c <= 8192]
        a.decode_to = min(a.decode_to, 2100)
        a.rounds = 1
    if a.offgraph_capacities is None:
        a.offgraph_capacities = sorted(set(a.capacities) | ({32768} if 32768 in a.stock_capacities else set()))
    return a


def _env(workdir: Path, threads: Optional[int] = None) -> Dict[str, str]:
    env = dict(os.environ)
    # A cache of our own: compiles are cold in every run (honest build times), and nothing leaks between runs.
    env["TORCHINDUCTOR_CACHE_DIR"] = str(workdir / "inductor_cache")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONWARNINGS", "ignore")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _run(cmd: List[str], log: Path, env: Dict[str, str]) -> int:
    with open(log, "w") as f:
        return subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def build_all(jobs: List[tuple], workdir: Path, a: argparse.Namespace) -> tuple:
    builds: Dict[str, dict] = {}
    failed: Dict[str, str] = {}
    env = _env(workdir)

    def one(kind: str, cap: int) -> tuple:
        out = workdir / f"{kind}_{cap}{SUFFIX[kind]}"
        log = workdir / f"build_{kind}_{cap}.log"
        cmd = [sys.executable, "-m", "benchmarks.lib.artifacts", "--kind", kind, "--capacity", str(cap),
               "--max-write", str(a.max_write), "--workdir", str(workdir), "--out", str(out)]
        rc = _run(cmd, log, env)
        info_path = Path(str(out) + ".build.json")
        if rc != 0 or not info_path.is_file():
            return kind, cap, None, f"build failed (rc {rc}):\n{_tail(log)}"
        return kind, cap, json.loads(info_path.read_text()), None

    with cf.ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool, \
            tqdm(total=len(jobs), desc="build", unit="program", file=sys.stderr) as bar:
        futures = [pool.submit(one, k, c) for k, c in jobs]
        for fut in cf.as_completed(futures):
            kind, cap, info, err = fut.result()
            key = report.name(kind, cap)
            if err:
                failed[key] = err
                tqdm.write(f"  {key}: {err.splitlines()[0]}", file=sys.stderr)
            else:
                builds[key] = info
                tqdm.write(f"  built {key}: {info['bytes'] / 2**20:.2f} MiB in {info['build_s']:.0f}s", file=sys.stderr)
            bar.update(1)
    return builds, failed


def _merge_round(first: dict, later: dict) -> None:
    """Fold a later timing round into the first: memory stays the first round's, times take the minimum."""
    first.setdefault("decode_ms_per_round", [dict(first["decode_ms"])])
    first["decode_ms_per_round"].append(dict(later["decode_ms"]))
    for c, v in later["decode_ms"].items():
        if v is not None and (first["decode_ms"].get(c) is None or v < first["decode_ms"][c]):
            first["decode_ms"][c] = v
    first["step_ms"] = [min(x, y) for x, y in zip(first["step_ms"], later["step_ms"])]
    busy = [b for b in (first.get("decode_others_busy"), later.get("decode_others_busy")) if b is not None]
    first["decode_others_busy"] = max(busy) if busy else None
    if first.get("prefill") and later.get("prefill"):
        pf = first["prefill"]
        pf.setdefault("tokens_per_s_per_round", [pf["tokens_per_s"]])
        pf["tokens_per_s_per_round"].append(later["prefill"]["tokens_per_s"])
        pf["tokens_per_s"] = max(pf["tokens_per_s_per_round"])
    if first.get("growth") and later.get("growth"):
        first["growth"].setdefault("growth_time_share_per_round", [first["growth"]["growth_time_share"]])
        first["growth"]["growth_time_share_per_round"].append(later["growth"]["growth_time_share"])


def measure_all(order: List[str], builds: Dict[str, dict], workdir: Path, a: argparse.Namespace) -> tuple:
    """Round 1 measures everything; later rounds (fresh processes, reversed order) only add timing samples."""
    runs: Dict[str, dict] = {}
    failed: Dict[str, str] = {}
    env = _env(workdir, a.threads)
    todo = [k for k in order if k in builds]
    plan = [(r, k) for r in range(a.rounds) for k in (todo if r % 2 == 0 else todo[::-1])]
    with tqdm(plan, desc="measure", unit="run", file=sys.stderr) as bar:
        for rnd, key in bar:
            if rnd and key not in runs:
                continue
            b = builds[key]
            bar.set_postfix_str(f"round {rnd + 1} {key}")
            out = workdir / f"measure_{key.replace('@', '_')}_r{rnd + 1}.json"
            log = workdir / f"measure_{key.replace('@', '_')}_r{rnd + 1}.log"
            cmd = [sys.executable, "-m", "benchmarks.lib.measure", "--kind", b["kind"], "--artifact", b["path"],
                   "--capacity", str(b["capacity"]), "--max-write", str(a.max_write), "--decode-to", str(a.decode_to),
                   "--window", str(a.window), "--repeats", str(a.repeats), "--passes", str(a.passes),
                   "--threads", str(a.threads), "--out", str(out)]
            t0 = time.perf_counter()
            rc = _run(cmd, log, env)
            if rc != 0 or not out.is_file():
                if rnd == 0:
                    failed[key] = f"measure failed (rc {rc}):\n{_tail(log)}"
                tqdm.write(f"  {key}: measure failed in round {rnd + 1} (rc {rc})", file=sys.stderr)
                continue
            r = json.loads(out.read_text())
            if rnd == 0:
                runs[key] = r
                r["measure_s"] = round(time.perf_counter() - t0, 1)
            else:
                _merge_round(runs[key], r)
                runs[key]["measure_s"] += round(time.perf_counter() - t0, 1)
            tqdm.write(f"  round {rnd + 1} {key}: load +{r['rss_load_mib']:.1f} MiB, decode@200 "
                       f"{report._fmt(report.decode_ms(r, 200), '.3f')} ms @2000 "
                       f"{report._fmt(report.decode_ms(r, 2000), '.3f')} ms, others busy "
                       f"{100 * (r['decode_others_busy'] or 0):.0f}%", file=sys.stderr)
    return runs, failed


def measure_interleaved(builds: Dict[str, dict], workdir: Path, a: argparse.Namespace) -> Optional[dict]:
    """The offgraph-kv capacity variants decoded in turns in one process (``interleaved.py``)."""
    og = sorted((b for b in builds.values() if b["kind"] == "offgraph"), key=lambda b: b["capacity"])
    if len(og) < 2:
        return None
    out, log = workdir / "interleaved.json", workdir / "interleaved.log"
    cmd = [sys.executable, "-m", "benchmarks.lib.interleaved", "--threads", str(a.threads),
           "--max-write", str(a.max_write), "--out", str(out)]
    for b in og:
        cmd += ["--artifact", f"{b['capacity']}={b['path']}"]
    print("decoding the offgraph-kv capacities in turns in one process ...", file=sys.stderr, flush=True)
    rc = _run(cmd, log, _env(workdir, a.threads))
    if rc != 0 or not out.is_file():
        return {"error": f"rc {rc}:\n{_tail(log)}"}
    return json.loads(out.read_text())


def check_same_model(runs: Dict[str, dict]) -> Dict[str, dict]:
    """Largest logit gap of every program to the offgraph program of the largest capacity, per checked step."""
    og = report.by_kind(runs, "offgraph")
    if not og:
        return {}
    ref = og[-1]
    out = {}
    for key, r in runs.items():
        gaps = {}
        for step, logits in r["check_logits"].items():
            other = ref["check_logits"].get(step)
            if other is not None:
                gaps[step] = max(abs(x - y) for x, y in zip(logits, other))
        out[key] = {"reference": report.name("offgraph", ref["capacity"]), "max_abs_logit_gap": gaps}
    return out


def source_state() -> Dict[str, object]:
    """The commit and the uncommitted changes of the code under test (others may edit it during a run)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    paths = ["backend", "partitioner", "runtime", "schemas", "examples/llama/model.py"]
    return {"commit": git("rev-parse", "HEAD"), "dirty": git("status", "--porcelain", "--", *paths).splitlines()}


@dataclass
class Measured:
    """What one run of the suite built and measured: everything its report needs."""

    started: str
    info: Dict[str, object]
    model_args: object  # examples/llama ModelArgs
    bpt: int
    order: List[str]
    builds: Dict[str, dict]
    runs: Dict[str, dict]
    interleaved: Optional[dict]
    not_done: Dict[str, str]
    source: Dict[str, Dict[str, object]]
    wall: float


def build_programs(a: argparse.Namespace, workdir: Path) -> Tuple[object, int, Dict[str, dict], Dict[str, str]]:
    """The weights once, then every program from them: model args, KV bytes/token, builds, failures."""
    from benchmarks.lib import artifacts  # imports torch and the example model

    artifacts.write_weights(workdir)
    args = artifacts.model_args()
    bpt = artifacts.kv_bytes_per_token(args, 4)

    # Longest builds first so the two build slots stay busy.
    jobs = [("stock", c) for c in a.stock_capacities]
    jobs += [("offgraph", c) for c in a.offgraph_capacities]
    jobs += [(k, c) for c in a.capacities for k in ("static-mask", "static-prefix")]
    builds, failed = build_all(jobs, workdir, a)
    return args, bpt, builds, failed


def program_order(a: argparse.Namespace) -> List[str]:
    """Every program's name, by capacity, then kind: the order of the table, the plots and the runs."""
    caps = sorted(set(a.capacities) | set(a.stock_capacities) | set(a.offgraph_capacities))
    return [report.name(k, c) for c in caps for k in ("stock", "static-mask", "static-prefix", "offgraph")]


def run_suite(a: argparse.Namespace, workdir: Path) -> Measured:
    """Build, then measure: each program alone in fresh processes, then the offgraph-kv capacities in turns."""
    src_before = source_state()
    wall0 = time.perf_counter()
    started = machine.now_utc()
    info = machine.describe()
    print(f"offgraph-kv CPU benchmark, {started}\n  {info['cpu_model']}, {info['cores']} cores, {info['platform']}\n"
          f"  torch {info['torch']}, executorch {info['executorch']}; workdir {workdir}", flush=True)

    args, bpt, builds, build_failed = build_programs(a, workdir)
    order = program_order(a)
    runs, measure_failed = measure_all(order, builds, workdir, a)
    interleaved = measure_interleaved(builds, workdir, a)
    not_done = {**build_failed, **measure_failed}
    if interleaved and "error" in interleaved:
        not_done["interleaved"] = interleaved["error"]

    src_after = source_state()
    if src_after != src_before:
        not_done["source"] = (f"the code under test changed during the run (commit {src_before['commit'][:10]} -> "
                              f"{src_after['commit'][:10]}, dirty {src_before['dirty']} -> {src_after['dirty']}): "
                              "programs may come from different versions; run again")
    return Measured(started=started, info=info, model_args=args, bpt=bpt, order=order, builds=builds, runs=runs,
                    interleaved=interleaved, not_done=not_done, source={"before": src_before, "after": src_after},
                    wall=time.perf_counter() - wall0)


NOTES = {
    "baseline_1": "executorch.examples.models.llama.export_llama -kv --use_sdpa_with_kv_cache -X -d fp32 "
                  "--max_seq_length min(C, 512) --max_context_length C, from a Meta-format checkpoint + "
                  "params.json of the same weights (q/k permuted to Meta's interleaved RoPE layout). Its "
                  "sdpa_with_kv_cache op attends over the filled prefix; it returns last-position logits "
                  "only and takes at most max_seq_length - 1 tokens per call (prefill chunks 511 + 1).",
    "baseline_2": "static-mask: KV as registered buffers [1, C, H_kv, D] updated with index_copy_ at "
                  "input_pos; SDPA(enable_gqa) over the whole capacity with a lower-right causal mask "
                  "(what a static cache attends over). Compiled with torch._inductor.aot_compile "
                  "(aot_inductor.package False), run with AOTIModelContainerRunnerCpu. This is the "
                  "'baseline 2' of the targets.",
    "baseline_2b": "static-prefix: same buffers, attention over the first pos + T rows only "
                   "(data-dependent slice): a best-case static cache. Informational lines only.",
    "offgraph": "OffGraphKVPartitioner(storage_dtype=fp32, max_capacity=C, initial_capacity=256), max step "
                "width 512, loaded with executorch.runtime.",
    "memory": "RSS is VmRSS of a fresh process, relative to just before load (all kinds import the same "
              "modules first). All programs allocate scratch on the first step (visible as a jump in the "
              "first RSS sample). 'KV alloc' is the offgraph store's allocated_bytes.",
    "timing": "decode ms/token at context c = median of the steps at positions [c, c + window), the smallest over "
              "`passes` decode passes from an empty cache in each of `rounds` fresh processes (noise on a shared VM "
              "only adds time, in bursts that can cover a whole window or a whole process); every step "
              "is a 1-token call with a fixed pseudo-random token sequence (same inputs for all programs). "
              "Prefill: 512-token prompt from an empty cache, median of `repeats`; offgraph resets its "
              "store with memory released first, so prefill includes its growths.",
    "contention": "decode_others_busy is the share of the machine's cores other processes used during the "
                  "decode loop (other sessions run tests on these cores); medians over many steps absorb "
                  "short preemptions, but busy machines still skew absolute numbers.",
    "growth_time_share": "sum over decode steps that changed the capacity of (step time - median of the "
                         "nearby non-growth steps), divided by the total decode time.",
}


def result_json(a: argparse.Namespace, argv: Optional[List[str]], m: Measured, ts: List[dict], rts: List[dict],
                same: Dict[str, dict], contention: Dict[str, Optional[float]]) -> Dict[str, object]:
    from benchmarks.lib.artifacts import SEED

    slim_runs = {}
    for k, r in m.runs.items():
        s = dict(r)
        s["decode_trace_ms"] = [[round(x, 1), round(y, 4)] for x, y in report.rolling(r["step_ms"])]
        s.pop("step_ms")
        s["check_logits_steps"] = sorted(int(x) for x in s.pop("check_logits"))
        slim_runs[k] = s
    return {
        "benchmark": "offgraph-kv CPU", "date": m.started, "wall_s": round(m.wall, 1),
        "command": "python -m benchmarks.cpu " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": m.info,
        "source": m.source,
        "settings": {k: v for k, v in vars(a).items() if k not in ("workdir", "out_dir")},
        "model": {**m.model_args.to_dict(), "weights_dtype": "fp32", "kv_storage_dtype": "fp32",
                  "kv_bytes_per_token": m.bpt, "seed": SEED},
        "programs": {k: report.LABELS[k] for k in report.LABELS},
        "notes": NOTES,
        "builds": m.builds,
        "runs": slim_runs,
        "same_model_check": same,
        "interleaved_decode": m.interleaved,
        "targets": ts,
        "ratios": rts,
        "contention_others_busy": contention,
        "not_done": m.not_done,
    }


def growth_lines(runs: Dict[str, dict]) -> List[str]:
    """One line per offgraph-kv program: its growths, their extra time, prefill growths, host work."""
    lines = []
    for r in report.by_kind(runs, "offgraph"):
        g = r.get("growth") or {}
        m = r.get("metrics_after_decode") or {}
        share = g.get("growth_time_share")
        pf = (r.get("prefill") or {}).get("growths_per_prefill")
        lines.append(
            f"offgraph@{r['capacity']}: {m.get('growths')} growths over {r['decoded_tokens']} decode steps "
            f"(capacity {m.get('capacity')}), extra time {g.get('growth_extra_ms', 0):.2f} ms = "
            f"{100 * share:.3f}% of decode time" if share is not None else "n/a")
        lines[-1] += f"; prefill growths {pf[0] if pf else 'n/a'}; host overhead {m.get('host_us_per_step', 0):.1f} us/step"
    return lines


def summary_md(a: argparse.Namespace, m: Measured, tab: str, rtab: str, growth: List[str], busy: List[float],
               lines: List[str]) -> str:
    info = m.info
    md = [
        f"### CPU benchmark ({m.started[:10]})",
        "",
        f"{info['cpu_model']}, {info['cores']} cores, {info['platform']}; torch {info['torch']}, executorch "
        f"{info['executorch']}; {a.threads} compute thread(s) per program. Toy llama (dim 256, 4 layers, 8 q / 2 kv "
        f"heads, vocab 512), fp32 weights and KV ({m.bpt} KV bytes/token), same weights in every program. "
        f"`python -m benchmarks.cpu`, {m.wall / 60:.1f} min.",
        "",
        "Programs: **stock XNNPACK** = ExecuTorch `export_llama -kv --use_sdpa_with_kv_cache -X` (static KV); "
        "**AOTI static (mask)** = same AOTInductor path as offgraph-kv with KV as in-graph static buffers and "
        "attention over the whole capacity (baseline 2); **AOTI static (prefix)** = same, attending over the used "
        "prefix only (best-case static cache); **offgraph-kv** = delegate-owned KV (initial 256 rows, grows x2).",
        "",
        tab,
        "",
        rtab,
        "",
        *[f"- {ln}" for ln in growth],
        *([f"- other processes kept {100 * min(busy):.0f}-{100 * max(busy):.0f}% of the cores busy during the "
           "decode loops (shared machine)"] if busy else []),
        "",
        "```",
        *lines,
        *[f"NOT DONE    {k}: {v.splitlines()[0]}" for k, v in m.not_done.items()],
        "```",
        "",
        "![memory](benchmarks/results/cpu_memory.png) ![decode](benchmarks/results/cpu_decode.png)",
        "",
    ]
    return "\n".join(md)


def write_report(a: argparse.Namespace, argv: Optional[List[str]], m: Measured, out_dir: Path) -> None:
    """Targets, ratios and the same-model check; then cpu.json, the two plots, the printed table and cpu_summary.md."""
    runs = m.runs
    ts = report.targets(runs, m.builds, m.bpt, a.decode_tolerance, a.rss_tolerance_mib, m.interleaved)
    rts = report.ratios(runs)
    same = check_same_model(runs)
    contention = {k: r.get("decode_others_busy") for k, r in runs.items()}
    subtitle = (f"{m.info['cpu_model']}, {m.info['cores']} cores, {a.threads} thread(s) per program, "
                f"{m.started[:10]}")

    json_path = out_dir / "cpu.json"
    json_path.write_text(json.dumps(result_json(a, argv, m, ts, rts, same, contention), indent=1) + "\n")

    mem_png, dec_png = out_dir / "cpu_memory.png", out_dir / "cpu_decode.png"
    plot_err = None
    try:
        report.plot_memory(runs, m.order, m.bpt, str(mem_png), subtitle)
        report.plot_decode(runs, m.order, str(dec_png), subtitle)
    except ImportError as e:
        plot_err = f"plots skipped ({e}); pip install matplotlib"

    tab = report.table(runs, m.order)
    rtab = report.ratio_table(rts)
    lines = report.target_lines(ts)
    growth = growth_lines(runs)
    worst_gap = max((g for v in same.values() for g in v["max_abs_logit_gap"].values()), default=None)
    busy = [v for v in contention.values() if v is not None]
    print("\n" + tab + "\n\n" + rtab + "\n")
    for ln in growth:
        print("  " + ln)
    if worst_gap is not None:
        print(f"  same model: largest logit gap between any program and offgraph = {worst_gap:.2e}")
    if busy:
        print(f"  other processes kept {100 * min(busy):.0f}-{100 * max(busy):.0f}% of the cores busy during decode")
    print()
    for ln in lines:
        print(ln)
    for k, v in m.not_done.items():
        print(f"NOT DONE    {k}: {v.splitlines()[0]}")
    if plot_err:
        print(plot_err)
    print(f"\nwall time {m.wall / 60:.1f} min; wrote {json_path}, {mem_png.name}, {dec_png.name}, cpu_summary.md")
    (out_dir / "cpu_summary.md").write_text(summary_md(a, m, tab, rtab, growth, busy, lines))


def main(argv: Optional[List[str]] = None) -> int:
    a = parse_args(argv)
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="offgraph_kv_cpu_bench_"))
    workdir.mkdir(parents=True, exist_ok=True)
    measured = run_suite(a, workdir)
    write_report(a, argv, measured, out_dir)
    if not a.keep and not a.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    elif a.keep:
        print(f"kept {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
