"""One-token steps: the CUDA-core decode kernel's settings against the 16-row tl.dot kernel, in one run.

    python -m benchmarks.cuda.decode_variants --out decode_variants.json [--quick]

Llama-3-8B attention shapes (32 q / 8 kv heads x 128, bf16), timed as
``kernels.py`` times ours (``graph_time``: 20 calls in one CUDA graph, best of
5 replays, per call): a ring of window 4,096 (warm, and cold over 6 rings in
turn) and flat contexts 1K / 8K / 32K / 128K. For each layer kind, every
setting of ``triton_attention.DECODE`` (programs per SM, keys per block, warps,
stages) is timed beside the tl.dot kernel (``DECODE[kind] = None``), and each
setting's output is checked against the tl.dot kernel's on the same data.
The best settings are then timed per kernel (CUPTI). Shares are of memcpy
bandwidth over the K+V bytes read, as in ``kernels.py``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import triton

from benchmarks.cuda.kernels import decode_case, graph_time
from benchmarks.cuda.ring_floor import COLD_COPIES, HKV, HQ, WINDOW, D, _rings, _rotating, kernel_durations

FLAT_CONTEXTS = (1024, 8192, 32768, 131072)
Setting = Optional[Tuple[int, int, int, int]]


def _settings(quick: bool) -> List[Setting]:
    grid = itertools.product((2, 3, 4, 6) if not quick else (3,), (16, 32, 64), (2, 4, 8), (1, 2) if not quick else (2,))
    return [None] + list(grid)


def measure(quick: bool, memcpy_Bps: float, save: Callable[[], None], rows: Dict[str, object]) -> None:
    from offgraph_kv.backend import triton_attention as ta

    bf = torch.bfloat16
    scale = D ** -0.5
    rings = _rings(COLD_COPIES)
    ring_bytes = 2 * WINDOW * HKV * D * 2
    cases: Dict[str, Tuple[str, Callable[[], torch.Tensor], int]] = {}

    def ring_call(r: Dict[str, torch.Tensor]) -> Callable[[], torch.Tensor]:
        return lambda: ta.update_attend(r["q"], r["k"], r["v"], r["ks"], r["vs"], r["length"], WINDOW, scale, bf)

    cases["ring 4096"] = ("ring", ring_call(rings[0]), ring_bytes)
    cold = _rotating([ring_call(r) for r in rings])
    for ctx in FLAT_CONTEXTS:
        q, k, v, ks, vs, length, nbytes = decode_case(ctx, HQ, HKV, D)
        cases[f"flat {ctx}"] = ("flat", (lambda q=q, k=k, v=v, ks=ks, vs=vs, length=length:
                                         ta.update_attend(q, k, v, ks, vs, length, 0, scale, bf)), nbytes)
    defaults = dict(ta.DECODE)
    rows["settings"] = []
    try:
        for kind in ("ring", "flat"):
            names = [n for n, c in cases.items() if c[0] == kind]
            ta.DECODE[kind] = None
            want = {n: cases[n][1]().float() for n in names}
            for setting in _settings(quick):
                ta.DECODE[kind] = setting
                row: Dict[str, object] = {"kind": kind, "setting": setting}
                try:
                    for n in names:
                        got = cases[n][1]().float()
                        row[f"{n} max_err"] = (got - want[n]).abs().max().item()
                        t = graph_time(cases[n][1])
                        row[n] = {"us": t * 1e6, "share": cases[n][2] / t / memcpy_Bps}
                    if kind == "ring":
                        t = graph_time(cold)
                        row["ring 4096 cold"] = {"us": t * 1e6, "share": ring_bytes / t / memcpy_Bps}
                except Exception as e:  # out of registers or shared memory
                    row["error"] = str(e).splitlines()[0][:160]
                rows["settings"].append(row)
                print(json.dumps(row), flush=True)
                save()
            ta.DECODE[kind] = defaults[kind]
        for kind, key in (("ring", "ring 4096"), ("flat", "flat 8192")):
            ok = [r for r in rows["settings"] if r["kind"] == kind and key in r and r["setting"] is not None]
            rows[f"best {kind}"] = min(ok, key=lambda r: r[key]["us"])
            print(f"best {kind}: {json.dumps(rows[f'best {kind}'])}", flush=True)
        ta.DECODE["ring"] = tuple(rows["best ring"]["setting"])
        rows["profile ring best"] = kernel_durations(cases["ring 4096"][1], cases["ring 4096"][1])
    finally:
        ta.DECODE.clear()
        ta.DECODE.update(defaults)
    save()


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    p.add_argument("--quick", action="store_true", help="3 programs per SM and 2 stages only")
    a = p.parse_args(argv)
    from benchmarks.cuda.growth import memcpy_seconds

    mc = 1 << 30
    memcpy_Bps = 2 * mc / memcpy_seconds(mc)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python -m benchmarks.cuda.decode_variants " + " ".join(sys.argv[1:] if argv is None else argv),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "memcpy_TBps": memcpy_Bps / 1e12, "rows": {}}
    print(f"memcpy {memcpy_Bps / 1e12:.2f} TB/s", flush=True)

    def save() -> None:
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=2))

    measure(a.quick, memcpy_Bps, save, result["rows"])
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
