"""Turn the per-program measurements into targets, ratios, a table and plots.

The CPU suite's report, and the few pieces every suite writes its results with
(``verdict``, ``save``, ``rolling``)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Tuple

MIB = 2**20

LABELS = {
    "stock": "baseline 1: ExecuTorch stock (static KV, XNNPACK)",
    "static-mask": "baseline 2: AOTI, static KV buffers, mask over capacity",
    "static-prefix": "baseline 2b: AOTI, static KV buffers, attend used prefix",
    "offgraph": "offgraph-kv (delegate-owned KV)",
}
SHORT = {"stock": "stock XNNPACK", "static-mask": "AOTI static (mask)",
         "static-prefix": "AOTI static (prefix)", "offgraph": "offgraph-kv"}


def name(kind: str, capacity: int) -> str:
    return f"{kind}@{capacity}"


def _fmt(v: Optional[float], spec: str = ".2f") -> str:
    return "–" if v is None else format(v, spec)


def by_kind(runs: Dict[str, dict], kind: str) -> List[dict]:
    return sorted((r for r in runs.values() if r["kind"] == kind), key=lambda r: r["capacity"])


def decode_ms(run: Optional[dict], ctx: int) -> Optional[float]:
    return None if run is None else run["decode_ms"].get(str(ctx))


# --------------------------------------------------------------------------- #
# Targets
# --------------------------------------------------------------------------- #


def targets(runs: Dict[str, dict], builds: Dict[str, dict], bpt: int, decode_tol: float,
            rss_tol_mib: float, interleaved: Optional[dict] = None) -> List[dict]:
    out: List[dict] = []

    def add(target: str, ok: Optional[bool], detail: str, strict: bool = True) -> None:
        out.append({"target": target, "pass": ok, "detail": detail, "counts": strict})

    og = by_kind(runs, "offgraph")

    # 1. Memory independent of capacity (KV bytes exactly; RSS within a tolerance).
    for L in (200, 2000):
        have = [r for r in og if str(L) in r["metrics_at_tokens"]]
        if len(have) < 2:
            continue
        alloc = {r["capacity"]: r["metrics_at_tokens"][str(L)]["allocated_bytes"] for r in have}
        rss = {r["capacity"]: r["rss_at_tokens_mib"][str(L)] for r in have}
        spread = max(rss.values()) - min(rss.values())
        ok = len(set(alloc.values())) == 1 and spread <= rss_tol_mib
        add(f"offgraph memory at {L} tokens independent of capacity",
            ok, f"KV allocated {', '.join(f'C={c}: {a / MIB:.2f} MiB' for c, a in alloc.items())}; "
                f"RSS added {', '.join(f'C={c}: {v:.1f} MiB' for c, v in rss.items())} "
                f"(spread {spread:.1f} MiB, tolerance {rss_tol_mib:.1f})")
    loads = {r["capacity"]: r["rss_load_mib"] for r in og}
    if len(loads) >= 2:
        spread = max(loads.values()) - min(loads.values())
        add("offgraph RSS added by load independent of capacity", spread <= rss_tol_mib,
            f"{', '.join(f'C={c}: {v:.1f} MiB' for c, v in loads.items())} (spread {spread:.1f} MiB)")

    # 2. Memory follows the context: <= 2 x bytes/token x length (+ one growth step).
    for r in og:
        init_rows = (r["metrics_after_load"] or {}).get("initial_capacity", 256)
        gf = float((r["metrics_after_load"] or {}).get("growth_factor", 2.0))
        for L, m in sorted(r["metrics_at_tokens"].items(), key=lambda kv: int(kv[0])):
            steady = max(2 * bpt * int(L), bpt * init_rows)
            growth_step = m["allocated_bytes"] / gf  # the old allocation that coexists with the new during a copy
            ok = m["allocated_bytes"] <= steady and m["peak_bytes"] <= steady + growth_step
            add(f"offgraph@{r['capacity']} KV memory at {L} tokens <= 2 x bytes/token x length + one growth step",
                ok, f"allocated {m['allocated_bytes'] / MIB:.2f} MiB <= {steady / MIB:.2f} MiB; peak "
                    f"{m['peak_bytes'] / MIB:.2f} MiB <= {(steady + growth_step) / MIB:.2f} MiB "
                    f"(bytes/token {bpt}, initial {init_rows} rows)")

    # 3. Decode time independent of capacity: judged on the programs decoded in turns in one
    # process where that ran (separate processes meet different noise), else on the table's numbers.
    side_by_side = (interleaved or {}).get("contexts", {})
    for ctx in (200, 2000):
        if str(ctx) in side_by_side:
            have = {int(c): v for c, v in side_by_side[str(ctx)]["median_ms"].items()}
            how = "decoded in turns in one process"
        else:
            have = {r["capacity"]: decode_ms(r, ctx) for r in og if decode_ms(r, ctx) is not None}
            how = "separate processes"
        if len(have) < 2:
            continue
        ratio = max(have.values()) / min(have.values())
        add(f"offgraph decode at context {ctx} independent of capacity (max/min <= {decode_tol:.2f})",
            ratio <= decode_tol, f"{', '.join(f'C={c}: {v:.3f} ms' for c, v in have.items())} "
                                 f"(max/min {ratio:.3f}; {how})")

    # 4. Decode time vs baseline 2 at the same capacity and context.
    for base, strict in (("static-mask", True), ("static-prefix", False)):
        for r in og:
            b = runs.get(name(base, r["capacity"]))
            if b is None:
                continue
            for ctx in (200, 2000):
                o, s = decode_ms(r, ctx), decode_ms(b, ctx)
                if o is None or s is None:
                    continue
                tag = "baseline 2" if strict else "baseline 2b (prefix attention; stricter, informational)"
                add(f"offgraph@{r['capacity']} decode at context {ctx} <= 1.05 x {tag}",
                    o <= 1.05 * s, f"{o:.3f} ms vs {s:.3f} ms (ratio {o / s:.3f})", strict)

    # 5. One .pte for every capacity.
    ob = sorted((b for b in builds.values() if b["kind"] == "offgraph"), key=lambda b: b["capacity"])
    if len(ob) >= 2:
        sizes = {b["capacity"]: b["bytes"] for b in ob}
        named = {b["capacity"]: (b.get("pte_scan") or {}).get("named_data_bytes") for b in ob}
        diff = max(sizes.values()) - min(sizes.values())
        ok = diff <= 64 and (None in named.values() or len(set(named.values())) == 1)
        add(".pte size identical across capacities (± manifest ints)", ok,
            f"{', '.join(f'C={c}: {s:,} B' for c, s in sizes.items())} (max difference {diff} B; "
            f"compiled code + weights {', '.join(f'{v:,} B' for v in named.values() if v is not None) or 'n/a'})")
    return out


# --------------------------------------------------------------------------- #
# Ratios and table
# --------------------------------------------------------------------------- #


def ratios(runs: Dict[str, dict]) -> List[dict]:
    rows = []
    for r in by_kind(runs, "offgraph"):
        C = r["capacity"]
        for base in ("static-mask", "static-prefix", "stock"):
            b = runs.get(name(base, C))
            if b is None:
                continue
            row = {"offgraph": name("offgraph", C), "baseline": name(base, C)}
            for ctx in (200, 2000, 4000):
                o, s = decode_ms(r, ctx), decode_ms(b, ctx)
                row[f"decode_{ctx}"] = None if o is None or s is None else o / s
            for L in ("200", "2000"):
                o, s = r["rss_at_tokens_mib"].get(L), b["rss_at_tokens_mib"].get(L)
                row[f"rss_{L}"] = None if o is None or s is None else o / s
            row["rss_load"] = r["rss_load_mib"] / b["rss_load_mib"] if b["rss_load_mib"] else None
            po, pb = r.get("prefill"), b.get("prefill")
            row["prefill_tokens_per_s"] = po["tokens_per_s"] / pb["tokens_per_s"] if po and pb else None
            row["file_bytes"] = r["artifact_bytes"] / b["artifact_bytes"]
            rows.append(row)
    return rows


TABLE_HEAD = ("| program | capacity | file MiB | RSS at load MiB | RSS @200 tok | RSS @2000 tok | KV alloc @200 / @2000 "
              "| decode ms @200 | @2000 | @4000 | prefill 512 tok/s |")


def table(runs: Dict[str, dict], order: List[str]) -> str:
    lines = [TABLE_HEAD, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key in order:
        r = runs.get(key)
        if r is None:
            continue
        kv = "–"
        if r["metrics_at_tokens"]:
            kv = " / ".join(f"{r['metrics_at_tokens'][L]['allocated_bytes'] / MIB:.2f}"
                            for L in ("200", "2000") if L in r["metrics_at_tokens"]) + " MiB"
        pf = r.get("prefill")
        lines.append(
            f"| {SHORT[r['kind']]} | {r['capacity']} | {r['artifact_bytes'] / MIB:.2f} | {r['rss_load_mib']:.1f} "
            f"| {_fmt(r['rss_at_tokens_mib'].get('200'), '.1f')} | {_fmt(r['rss_at_tokens_mib'].get('2000'), '.1f')} "
            f"| {kv} | {_fmt(decode_ms(r, 200), '.3f')} | {_fmt(decode_ms(r, 2000), '.3f')} "
            f"| {_fmt(decode_ms(r, 4000), '.3f')} | {_fmt(pf['tokens_per_s'] if pf else None, ',.0f')} |")
    return "\n".join(lines)


def ratio_table(rows: List[dict]) -> str:
    lines = ["| offgraph / baseline | decode @200 | decode @2000 | RSS at load | RSS @200 | RSS @2000 | prefill tok/s | file |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['offgraph']} / {r['baseline']} | {_fmt(r['decode_200'])} | {_fmt(r['decode_2000'])} "
                     f"| {_fmt(r['rss_load'])} | {_fmt(r['rss_200'])} | {_fmt(r['rss_2000'])} "
                     f"| {_fmt(r['prefill_tokens_per_s'])} | {_fmt(r['file_bytes'])} |")
    return "\n".join(lines)


def target_lines(ts: List[dict]) -> List[str]:
    out = []
    for t in ts:
        verdict = "PASS" if t["pass"] else "FAIL"
        if not t["counts"]:
            verdict += " (info)"
        out.append(f"{verdict:<11} {t['target']}: {t['detail']}")
    return out


# --------------------------------------------------------------------------- #
# Plots
# --------------------------------------------------------------------------- #


def rolling(step_ms: List[float], bucket: int = 32) -> List[Tuple[float, float]]:
    """Median per bucket of steps, at the bucket's middle context."""
    out = []
    for s in range(0, len(step_ms) - bucket + 1, bucket):
        out.append((s + bucket / 2, statistics.median(step_ms[s:s + bucket])))
    return out


_STYLE = {"stock": ("tab:gray", "-"), "static-mask": ("tab:red", "-"), "static-prefix": ("tab:orange", "-"),
          "offgraph": ("tab:blue", "-")}
_DASH = {512: (0, (1, 1)), 8192: "-", 32768: (0, (5, 2))}


def plot_memory(runs: Dict[str, dict], order: List[str], bpt: int, path: str, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for key in order:
        r = runs.get(key)
        if r is None:
            continue
        color, _ = _STYLE[r["kind"]]
        xs, ys = zip(*r["rss_trace_mib"])
        ax.plot(xs, ys, color=color, linestyle=_DASH.get(r["capacity"], "-"), marker=".", markersize=3,
                label=f"{SHORT[r['kind']]} C={r['capacity']}: RSS added")
    for r in by_kind(runs, "offgraph"):
        if r.get("alloc_trace"):
            xs = [0] + [a[0] for a in r["alloc_trace"]]
            ys = [r["metrics_after_load"]["allocated_bytes"] / MIB] + [a[1] / MIB for a in r["alloc_trace"]]
            ax.step(xs, ys, where="post", color="tab:cyan", linestyle=_DASH.get(r["capacity"], "-"),
                    label=f"offgraph-kv C={r['capacity']}: KV allocated")
    longest = max((r["decoded_tokens"] for r in runs.values()), default=0)
    ax.plot([0, longest], [0, 2 * bpt * longest / MIB], color="black", linestyle=":", linewidth=1,
            label="2 x KV bytes/token x length")
    ax.set_xlabel("generated tokens (context length)")
    ax.set_ylabel("MiB")
    ax.set_title(f"Memory vs generated tokens (4-layer toy llama, fp32)\n{subtitle}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_decode(runs: Dict[str, dict], order: List[str], path: str, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for key in order:
        r = runs.get(key)
        if r is None or not r.get("step_ms"):
            continue
        color, _ = _STYLE[r["kind"]]
        pts = rolling(r["step_ms"])
        if not pts:
            continue
        xs, ys = zip(*pts)
        ax.plot(xs, ys, color=color, linestyle=_DASH.get(r["capacity"], "-"),
                label=f"{SHORT[r['kind']]} C={r['capacity']}")
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens already in the cache)")
    ax.set_ylabel("decode ms/token (median of 32 steps)")
    ax.set_title(f"Decode time vs context (4-layer toy llama, fp32)\n{subtitle}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def verdict(ok: Optional[bool]) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def save(result: Dict[str, object], out: Optional[str]) -> None:
    """Write what is measured so far (a run cut short still leaves its numbers)."""
    if out:
        Path(out).write_text(json.dumps(result, indent=2))
