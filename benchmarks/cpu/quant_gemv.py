"""One-row quantized linears per kernel, SmolLM2's shapes, one thread, candidates interleaved.

    python -m benchmarks.cpu.quant_gemv [--dtypes bf16,fp32] [--rounds 5]

The one-row forms of ``backend/quantized_linear.py`` (compiled by inductor's
C++ backend through ``torch.compile``, rows dynamic as in the exported
``torch.cond`` branch) against what one row ran before: ATen's int8 GEMM
(bf16), torchao's dequantize-then-``mm`` (int8 in fp32, int4 compiled the
same way) and the float reduction of ``decode_gemv`` over the bf16 / fp32
weight. Weights stay in cache between calls (a kernel's compute, not the
memory's speed); the microseconds are the fastest round's median call.
Writes ``benchmarks/results/cpu_quant_gemv.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable, Dict, List

import torch

from benchmarks.lib.machine import describe, now_utc
from benchmarks.lib.paths import RESULTS
from offgraph_kv.backend import decode_gemv
from offgraph_kv.backend import quantized_linear as ql

SHAPES = {"wq/wo 576x576": (576, 576), "w1/w3 1536x576": (1536, 576), "w2 576x1536": (576, 1536),
          "output 49152x576": (49152, 576)}
GROUP = 32


def _median_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(5):
        fn()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2] * 1e6


def _compiled(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    c = torch.compile(fn, fullgraph=True)

    def call(x: torch.Tensor, *w: object) -> torch.Tensor:
        torch._dynamo.mark_dynamic(x, 0)  # rows symbolic, as in the exported branch
        return c(x, *w)
    return call


def candidates(n: int, k: int, dtype: torch.dtype) -> Dict[str, Callable[[], torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    s8 = torch.rand(n, generator=g).to(dtype)
    q4 = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g)
    s4 = torch.rand(n, k // GROUP, generator=g).to(dtype)
    packed = ql.pack_int4(q4, GROUP)

    def torchao_int4(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        wt = (q.float().reshape(n, k // GROUP, GROUP) * s.float().unsqueeze(-1)).reshape(n, k).to(x.dtype)
        return torch.mm(x, wt.t())

    float_row = _compiled(decode_gemv._one_row)
    i8_row, i4_row = _compiled(ql.int8_one_row), _compiled(lambda x, p, s: ql.int4_one_row(x, p, s, None))
    i8_deq, i4_deq = _compiled(lambda x, q, s: torch.mm(x, q.t().to(x.dtype)) * s), _compiled(torchao_int4)
    want8 = x.float() @ (q8.float() * s8.float()[:, None]).t()
    want4 = x.float() @ (q4.float().reshape(n, -1, GROUP) * s4.float().unsqueeze(-1)).reshape(n, k).t()
    for got, want in ((i8_row(x, q8, s8), want8), (i4_row(x, packed, s4), want4)):
        torch.testing.assert_close(got.float(), want, atol=2e-2 * float(want.abs().max()), rtol=0)
    out: Dict[str, Callable[[], torch.Tensor]] = {
        f"{'bf16' if dtype == torch.bfloat16 else 'fp32'} weight, float reduction": lambda: float_row(x, w),
        "int8 reduction": lambda: i8_row(x, q8, s8),
        "int8 dequantize + mm": lambda: i8_deq(x, q8, s8),
        "int4 packed reduction": lambda: i4_row(x, packed, s4),
        "int4 dequantize + mm": lambda: i4_deq(x, q4, s4),
    }
    if dtype == torch.bfloat16:
        out["int8 ATen _weight_int8pack_mm"] = lambda: torch.ops.aten._weight_int8pack_mm(x, q8, s8)
    return out


def main(argv: "List[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--shapes", default=",".join(SHAPES))
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rows: List[Dict[str, object]] = []
    for dname in a.dtypes.split(","):
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dname]
        for shape in a.shapes.split(","):
            n, k = SHAPES[shape]
            cands = candidates(n, k, dtype)
            best: Dict[str, float] = {}
            for _ in range(a.rounds):  # candidates take turns, so drift lands on all alike
                for name, fn in cands.items():
                    best[name] = min(best.get(name, float("inf")), _median_us(fn, a.calls))
            for name, us in best.items():
                rows.append({"dtype": dname, "shape": shape, "kernel": name, "us": us,
                             "gweights_per_s": n * k / us / 1e3})
                print(f"{dname} {shape:18s} {name:34s} {us:9.1f} us {n * k / us / 1e3:6.1f} Gweights/s", flush=True)
    result = {"when": now_utc(), "machine": describe(), "command": "python -m benchmarks.cpu.quant_gemv "
              + " ".join(argv if argv is not None else sys.argv[1:]), "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cpu_quant_gemv.json").write_text(json.dumps(result, indent=1))
    md = [f"### One-row quantized linears per kernel ({result['when']})", "", f"`{result['command']}`; one thread; "
          "weights in cache (compute, not memory); fastest round's median call.", "",
          "| dtype | shape | kernel | µs | Gweights/s |", "|---|---|---|---:|---:|"]
    md += [f"| {r['dtype']} | {r['shape']} | {r['kernel']} | {r['us']:.1f} | {r['gweights_per_s']:.1f} |" for r in rows]
    (RESULTS / "cpu_quant_gemv.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
