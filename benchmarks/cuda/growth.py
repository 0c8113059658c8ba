"""Growth-copy bandwidth of the CUDA store against a plain device-to-device copy, in one run.

    python -m benchmarks.cuda.growth --out results/cuda_growth.json

A growth is one stream-ordered allocation for every flat tensor (the arena),
one copy per tensor of its committed prefix (sequence-major layout: each is
contiguous), and the release of the old arena. The copies are submitted three
ways in the same run: one launch of the runtime's copy kernel over all tensors
(the default), one cudaMemcpyBatchAsync, and one cudaMemcpyAsync per tensor.

Everything is timed by CUDA events, like with like:
- the growth copy (events around the one batch of copies) against one memcpy
  of the same bytes (events around one cudaMemcpyAsync): one submission each,
  so both include their launch. This is the judged ratio.
- the same copy against the memcpy's back-to-back rate (ten copies between two
  events, launches overlapped): the device's streaming limit.
- the whole growth (allocation of fresh memory, as in real use: a completed
  step leaves the pool holding only the arena in use; copy; release) and its
  host wall time, which adds the allocation calls and a synchronisation.
- the kernel's growths again into memory the pool still holds (warm pages),
  and the kernel's grid swept (blocks per multiprocessor).
Bandwidth counts bytes read + written (twice the bytes copied), as memcpy bandwidth figures usually do.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from typing import Dict, List

import torch

# Benchmark hooks: build with -C cmake.define.OFFGRAPH_KV_BENCHMARKS=ON (benchmarks/device/gpu_setup.sh does).
from offgraph_kv.runtime import _bench

# 32 layers, 8 KV heads, head dim 128, bf16: 128 KiB of KV per token.
SHAPE = {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16"}


def _copy_pair(nbytes: int) -> "tuple[torch.Tensor, torch.Tensor]":
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm
    torch.cuda.synchronize()
    return src, dst


def memcpy_seconds(nbytes: int, repeats: int = 10) -> float:
    """Mean of `repeats` back-to-back copies between two events (launches overlapped)."""
    src, dst = _copy_pair(nbytes)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats / 1e3


def one_memcpy_seconds(nbytes: int, repeats: int = 10) -> float:
    """Mean over `repeats` of one copy between two events, as a growth submits its one copy."""
    src, dst = _copy_pair(nbytes)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    total = 0.0
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        total += start.elapsed_time(end) / 1e3
    return total / repeats


COPY_MODES = ("kernel", "batch", "each")


def growth_rows(copy_mode: str = "kernel", sizes: "tuple[int, ...]" = (1024, 4096, 16384, 32768),
                fresh_memory: bool = True) -> List[Dict[str, object]]:
    rows = []
    for before in sizes:
        t = _bench.time_growth("cuda", SHAPE["layers"], SHAPE["kv_heads"], SHAPE["head_dim"], SHAPE["dtype"],
                                    before, 2 * before, 5, copy_mode, fresh_memory)
        copied = t["bytes_copied"]
        single, streaming = one_memcpy_seconds(copied), memcpy_seconds(copied)
        bw = {name: 2 * copied / sec for name, sec in (
            ("copy", t["copy_device_seconds"]), ("memcpy", single), ("memcpy_back_to_back", streaming),
            ("growth", t["device_seconds"]), ("growth_wall", t["seconds"]))}
        rows.append({
            "rows_before": before, "rows_after": 2 * before, "bytes_copied": copied, "copy_mode": copy_mode,
            "fresh_memory": fresh_memory,
            "copy_device_seconds": t["copy_device_seconds"], "growth_device_seconds": t["device_seconds"],
            "growth_wall_seconds": t["seconds"], "memcpy_seconds": single, "memcpy_back_to_back_seconds": streaming,
            **{f"{name}_TBps": v / 1e12 for name, v in bw.items()},
            "ratio": bw["copy"] / bw["memcpy"],
            "ratio_vs_back_to_back": bw["copy"] / bw["memcpy_back_to_back"],
            "growth_ratio": bw["growth"] / bw["memcpy"],
            "wall_ratio": bw["growth_wall"] / bw["memcpy"],
        })
        r = rows[-1]
        label = copy_mode if fresh_memory else copy_mode + " warm"
        print(f"{label:>11} {before:>6} -> {2 * before:>6} rows  {copied / 2**20:8.1f} MiB  copy "
              f"{bw['copy'] / 1e12:5.2f} TB/s  memcpy {bw['memcpy'] / 1e12:5.2f} TB/s  ratio {r['ratio']:5.2f}  "
              f"{'PASS' if r['ratio'] >= 0.9 else 'FAIL'} (>= 0.90)  vs back-to-back memcpy "
              f"{bw['memcpy_back_to_back'] / 1e12:5.2f} TB/s: {r['ratio_vs_back_to_back']:5.2f}  whole growth "
              f"{r['growth_ratio']:5.2f}  host wall {r['wall_ratio']:5.2f}")
    return rows


def grid_rows(blocks_per_sm: "tuple[int, ...]" = (2, 4, 6, 8, 12, 16, 24, 32),
              sizes: "tuple[int, ...]" = (1024, 4096)) -> List[Dict[str, object]]:
    """The copy kernel's grid swept in the same run: blocks per multiprocessor against copy bandwidth."""
    rows = []
    try:
        for n in blocks_per_sm:
            grid = _bench.set_copy_kernel_grid(n)
            for before in sizes:
                t = _bench.time_growth("cuda", SHAPE["layers"], SHAPE["kv_heads"], SHAPE["head_dim"],
                                            SHAPE["dtype"], before, 2 * before, 5, "kernel")
                single = one_memcpy_seconds(t["bytes_copied"])
                rows.append({**grid, "rows_before": before, "bytes_copied": t["bytes_copied"],
                             "copy_device_seconds": t["copy_device_seconds"], "memcpy_seconds": single,
                             "ratio": single / t["copy_device_seconds"]})
                print(f"grid {n:>2} blocks/SM ({grid['resident_blocks_per_sm']} resident)  {before:>6} rows  "
                      f"copy/memcpy {rows[-1]['ratio']:5.2f}")
    finally:
        _bench.set_copy_kernel_grid(0)
    return rows


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "host": platform.node(),
        "command": f"python -m benchmarks.cuda.growth --out {args.out}",
        "shape": SHAPE,
        **{mode: growth_rows(mode) for mode in COPY_MODES},
        # The same growths into memory the pool already holds: what fresh pages cost the copy.
        "kernel_warm_pool": growth_rows("kernel", fresh_memory=False),
        "kernel_grid": grid_rows(),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
