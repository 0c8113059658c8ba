"""Decode attention kernels on the delegate's own KV layout, side by side (H200).

    python -m benchmarks.cuda.attention --out results/cuda_attention_h200.json

One decode query (batch 1) of Llama-3-8B attention shape (32 query heads,
8 KV heads, head dim 128, bf16) over one layer's history, read the way the
compiled step reads it: K/V are views ``[1, H_kv, S, D]`` of sequence-major
storage ``[1, capacity, H_kv, D]``. For each torch SDPA backend, two query
forms: GQA through ``enable_gqa`` (query ``[1, 32, 1, 128]``) and the
delegate's folding of each KV head's query group onto the query axis (query
``[1, 8, 4, 128]``, no K/V repeat), plus the masked form the delegate used
before it had a decode branch.

Two timings per row: the context held fixed (what a kernel costs once its
plan is cached) and the context growing by one every call (what a decode
loop sees; a backend that builds a plan per shape pays for it here).
Bandwidth is K+V bytes read over the time, as a share of device memcpy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPE = {"n_heads": 32, "n_kv_heads": 8, "head_dim": 128}
BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def _time(fn: Callable[[int], None], lengths: List[int]) -> float:
    """Mean seconds of fn over the given lengths (after one warm-up on the first)."""
    fn(lengths[0])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for n in lengths:
        fn(n)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / len(lengths) / 1e3


def attention_rows(contexts: List[int], memcpy_Bps: float, calls: int = 40,
                   shape: Dict[str, int] = SHAPE) -> List[Dict[str, object]]:
    hq, hkv, d = shape["n_heads"], shape["n_kv_heads"], shape["head_dim"]
    g = hq // hkv
    rows: List[Dict[str, object]] = []
    for ctx in contexts:
        cap = ctx + calls + 1
        k_store = torch.randn(1, cap, hkv, d, device="cuda", dtype=torch.bfloat16)
        v_store = torch.randn_like(k_store)
        q = torch.randn(1, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        folded = q.view(1, hkv, g, d)

        def kv(n: int):  # noqa: ANN202
            return k_store[:, :n].transpose(1, 2), v_store[:, :n].transpose(1, 2)

        forms = {
            "enable_gqa": lambda n: F.scaled_dot_product_attention(q, *kv(n), enable_gqa=True),
            "folded": lambda n: F.scaled_dot_product_attention(folded, *kv(n)),
            "folded_masked": lambda n: F.scaled_dot_product_attention(
                folded, *kv(n), attn_mask=torch.ones(g, n, dtype=torch.bool, device="cuda")),
        }
        kv_bytes = 2 * ctx * hkv * d * 2
        for backend in BACKENDS:
            for form, fn in forms.items():
                row: Dict[str, object] = {"context": ctx, "backend": backend, "form": form, "kv_bytes": kv_bytes}
                try:
                    with sdpa_kernel([getattr(SDPBackend, backend)]):
                        fixed = _time(fn, [ctx] * calls)
                        growing = _time(fn, list(range(ctx, ctx + calls)))
                    row.update(fixed_ms=fixed * 1e3, growing_ms=growing * 1e3,
                               fixed_share=kv_bytes / fixed / memcpy_Bps, growing_share=kv_bytes / growing / memcpy_Bps)
                except RuntimeError as e:
                    row["error"] = str(e).splitlines()[0][:160]
                rows.append(row)
                if "error" in row:
                    print(f"{ctx:>6} {backend:<20} {form:<14} n/a ({row['error'][:70]})", flush=True)
                else:
                    print(f"{ctx:>6} {backend:<20} {form:<14} fixed {row['fixed_ms']:.4f} ms "
                          f"({100 * row['fixed_share']:.0f} %)  growing {row['growing_ms']:.4f} ms "
                          f"({100 * row['growing_share']:.0f} %)", flush=True)
        del k_store, v_store
    return rows


def best_share(rows: List[Dict[str, object]], ctx: int, key: str = "growing_share") -> Dict[str, object]:
    """The fastest torch backend/form at ``ctx`` (what the delegate's decode must match)."""
    ok = [r for r in rows if r["context"] == ctx and key in r]
    return max(ok, key=lambda r: r[key]) if ok else {}


def main(argv: "list[str] | None" = None) -> int:
    from benchmarks.cuda.growth import memcpy_seconds

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="1024,8192,32768")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    mc = 1 << 30
    memcpy_Bps = 2 * mc / memcpy_seconds(mc)
    rows = attention_rows([int(c) for c in a.contexts.split(",")], memcpy_Bps)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "command": "python -m benchmarks.cuda.attention " + " ".join(sys.argv[1:] if argv is None else argv),
              "shape": SHAPE, "memcpy_TBps": memcpy_Bps / 1e12, "rows": rows}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
