"""Growth-copy bandwidth of the CUDA store against a plain device-to-device copy, in one run.

    python -m benchmarks.cuda_growth --out results/cuda_growth.json

The store's growth is allocate (stream-ordered) + one contiguous copy per tensor
+ release; sequence-major layout makes every copy a single memcpy of the
committed prefix. Bandwidth counts bytes read + written, as the memcpy does.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform

import torch

import offgraph_kv.runtime as rt


def memcpy_seconds(nbytes: int, repeats: int = 10) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats / 1e3


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    rows = []
    # 32 layers, 8 KV heads, head dim 128, bf16: 128 KiB of KV per token.
    for before in (1024, 4096, 16384, 32768):
        t = rt._runtime.time_growth("cuda", 32, 8, 128, "bf16", before, 2 * before, 5)
        copied = t["bytes_copied"]
        mc = memcpy_seconds(copied)
        growth_bw = 2 * copied / t["seconds"]
        memcpy_bw = 2 * copied / mc
        rows.append({
            "rows_before": before, "rows_after": 2 * before, "bytes_copied": copied,
            "growth_seconds": t["seconds"], "memcpy_seconds": mc,
            "growth_TBps": growth_bw / 1e12, "memcpy_TBps": memcpy_bw / 1e12,
            "ratio": growth_bw / memcpy_bw,
        })
        print(f"{before:>6} -> {2 * before:>6} rows  {copied / 2**20:8.1f} MiB  growth {growth_bw / 1e12:5.2f} TB/s  "
              f"memcpy {memcpy_bw / 1e12:5.2f} TB/s  ratio {growth_bw / memcpy_bw:5.2f}  "
              f"{'PASS' if growth_bw >= 0.9 * memcpy_bw else 'FAIL'} (>= 0.90)")
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "host": platform.node(),
        "command": "python -m benchmarks.cuda_growth --out benchmarks/results/cuda_growth_h200.json",
        "shape": {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16"},
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
