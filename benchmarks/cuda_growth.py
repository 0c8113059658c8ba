"""Growth-copy bandwidth of the CUDA store against a plain device-to-device copy, in one run.

    python -m benchmarks.cuda_growth --out results/cuda_growth.json

A growth is one stream-ordered allocation for every flat tensor, one copy per
tensor of its committed prefix (sequence-major layout: each is contiguous),
and the release of the old allocation. The copies are measured three ways in
the same run: one launch of the runtime's copy kernel over all tensors (the
default), one cudaMemcpyBatchAsync, and one cudaMemcpyAsync per tensor.
Bandwidth counts bytes read + written, as the memcpy does. The growth is timed
like the memcpy, by CUDA events (here on the store's stream, around the whole
growth: allocation, copy, release); its host wall time, which adds the
allocation calls and a synchronisation, is reported beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from typing import Dict, List

import torch

import offgraph_kv.runtime as rt

# 32 layers, 8 KV heads, head dim 128, bf16: 128 KiB of KV per token.
SHAPE = {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16"}


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


COPY_MODES = ("kernel", "batch", "each")


def growth_rows(copy_mode: str = "kernel",
                sizes: "tuple[int, ...]" = (1024, 4096, 16384, 32768)) -> List[Dict[str, object]]:
    rows = []
    for before in sizes:
        t = rt._runtime.time_growth("cuda", SHAPE["layers"], SHAPE["kv_heads"], SHAPE["head_dim"], SHAPE["dtype"],
                                    before, 2 * before, 5, copy_mode)
        copied = t["bytes_copied"]
        mc = memcpy_seconds(copied)
        # Like with like: the memcpy is timed by CUDA events, so is the growth on the store's stream.
        # The host wall time (allocation calls, copy, release and a sync) is kept beside it.
        growth_bw, memcpy_bw, wall_bw = 2 * copied / t["device_seconds"], 2 * copied / mc, 2 * copied / t["seconds"]
        rows.append({
            "rows_before": before, "rows_after": 2 * before, "bytes_copied": copied, "copy_mode": copy_mode,
            "growth_device_seconds": t["device_seconds"], "growth_wall_seconds": t["seconds"],
            "memcpy_seconds": mc, "growth_TBps": growth_bw / 1e12, "memcpy_TBps": memcpy_bw / 1e12,
            "ratio": growth_bw / memcpy_bw, "wall_ratio": wall_bw / memcpy_bw,
        })
        print(f"{copy_mode:>6} {before:>6} -> {2 * before:>6} rows  {copied / 2**20:8.1f} MiB  growth "
              f"{growth_bw / 1e12:5.2f} TB/s  memcpy {memcpy_bw / 1e12:5.2f} TB/s  ratio {growth_bw / memcpy_bw:5.2f}  "
              f"{'PASS' if growth_bw >= 0.9 * memcpy_bw else 'FAIL'} (>= 0.90)  host wall {wall_bw / memcpy_bw:5.2f}")
    return rows


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "host": platform.node(),
        "command": f"python -m benchmarks.cuda_growth --out {args.out}",
        "shape": SHAPE,
        **{mode: growth_rows(mode) for mode in COPY_MODES},
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
