"""What a ring decode step (window 4,096, Llama-3-8B attention shapes) can cost on this GPU.

    python -m benchmarks.cuda.ring_floor --out ring_floor.json [--sweep]
    ncu ... python -m benchmarks.cuda.ring_floor --probe 3     # eager calls only, for a profiler

Timed as ``benchmarks/cuda/kernels.py`` times ours (``graph_time``: 20 calls captured in
one CUDA graph, the best of 5 replays, per call), beside what bounds it:

- an empty kernel (1 and 264 programs): what one launch costs in a graph;
- a reader: one launch that loads the window's K and V rows as our kernel does (same
  strides, same programs, the length read from device memory first) and sums them:
  the floor of any one-launch attention over these bytes;
- ``copy_`` of half the window's bytes (so as many bytes move as the window holds, read plus
  written, the way the memcpy reference counts them);
- ours (the partial launch, then the combine launch), and each kernel's GPU time alone (CUPTI);
- each again **cold**: the graph rotates over 6 copies of the ring (5 others' 84 MB
  between two reads of one, more than the 50 MB L2), so a call reads its window from
  DRAM, as a model whose layers' windows do not fit the L2 together does; the
  benchmark's own number is warm (one ring, 16.8 MB, read 20 times in a row: much of
  it stays in the L2).

``--sweep``: ours over a ring's narrow-step programs per SM, keys per block, warps and stages.
Shares are of the device's memcpy bandwidth (1 GiB copy, read + written bytes), over
the window's K+V bytes, as in ``kernels.py``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path
from typing import Callable, Dict, List

import torch
import triton
import triton.language as tl

from benchmarks.cuda.kernels import decode_case, graph_time

HQ, HKV, D, WINDOW, MAX_WRITE = 32, 8, 128, 4096, 512
COLD_COPIES = 6


@triton.jit
def _empty(X):
    pass


@triton.jit
def _reader(KS, VS, LEN, OUT, sks_r, sks_h, slots, window, n_splits, BLOCK_N: tl.constexpr, D: tl.constexpr):
    # The attention kernel's loads without its arithmetic: the band's rows of one KV head.
    split = tl.program_id(0)
    h = tl.program_id(1)
    length = tl.load(LEN).to(tl.int64)
    lo = tl.maximum(length - window + 1, 0)
    per = tl.cdiv(tl.cdiv(length + 1 - lo, n_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per
    end = tl.minimum(start + per, length + 1)
    nb = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_N, D], tl.float32)
    for k0 in range(start, end, BLOCK_N):
        srow = (k0 % slots) + nb
        srow = tl.where(srow >= slots, srow - slots, srow)
        ok = (k0 + nb) < end
        k = tl.load(KS + srow[:, None] * sks_r + h * sks_h + d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(VS + srow[:, None] * sks_r + h * sks_h + d[None, :], mask=ok[:, None], other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(OUT + split * tl.num_programs(1) + h, tl.sum(tl.sum(acc, 1), 0))


def _rings(copies: int) -> List[Dict[str, torch.Tensor]]:
    slots = WINDOW + MAX_WRITE - 1
    out = []
    for _ in range(copies):
        ks = torch.randn(1, slots, HKV, D, device="cuda", dtype=torch.bfloat16)
        out.append({"ks": ks, "vs": torch.randn_like(ks),
                    "q": torch.randn(1, HQ, 1, D, device="cuda", dtype=torch.bfloat16),
                    "k": torch.randn(1, HKV, 1, D, device="cuda", dtype=torch.bfloat16),
                    "v": torch.randn(1, HKV, 1, D, device="cuda", dtype=torch.bfloat16),
                    "length": torch.tensor([100_003], device="cuda"),
                    "dst": torch.randn(2, WINDOW, HKV, D, device="cuda", dtype=torch.bfloat16)})
    return out


def _rotating(fns: List[Callable[[], object]]) -> Callable[[], object]:
    # One call per copy in turn; graph_time captures 20 calls, so each copy is read 5 times,
    # 3 others' windows (57 MB) in between.
    state = {"i": 0}

    def call() -> object:
        f = fns[state["i"] % len(fns)]
        state["i"] += 1
        return f()

    return call


def measure(sweep: bool, save: Callable[[], None], rows: Dict[str, object]) -> None:
    from offgraph_kv.backend import triton_attention as ta

    scale = D ** -0.5
    bf = torch.bfloat16
    kv_bytes = 2 * WINDOW * HKV * D * 2
    rings = _rings(COLD_COPIES)
    r0 = rings[0]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    scratch = torch.empty(4096, device="cuda", dtype=torch.float32)

    def ours(r: Dict[str, torch.Tensor]) -> Callable[[], object]:
        return lambda: ta.update_attend(r["q"], r["k"], r["v"], r["ks"], r["vs"], r["length"], WINDOW, scale, bf)

    def reader(r: Dict[str, torch.Tensor], splits: int, block_n: int = 64) -> Callable[[], object]:
        return lambda: _reader[(splits, HKV)](r["ks"], r["vs"], r["length"], scratch, r["ks"].stride(1),
                                              r["ks"].stride(2), r["ks"].shape[1], WINDOW, splits,
                                              BLOCK_N=block_n, D=D, num_warps=4, num_stages=3)

    def copy(r: Dict[str, torch.Tensor]) -> Callable[[], object]:
        # One contiguous copy of 8.4 MB: 16.8 MB moved, the window's bytes.
        return lambda: r["dst"][0].copy_(r["dst"][1])

    def timed(name: str, fn: Callable[[], object], nbytes: int = kv_bytes) -> None:
        t = graph_time(fn)
        rows[name] = {"us": t * 1e6, "share": nbytes / t / memcpy_Bps}
        print(f"{name:34s} {t * 1e6:7.2f} us  {rows[name]['share'] * 100:5.1f} %", flush=True)

    timed("empty kernel, 1 program", lambda: _empty[(1,)](scratch), 0)
    timed("empty kernel, 264 programs", lambda: _empty[(2 * sms,)](scratch), 0)
    for splits in (16, 33, 66):
        timed(f"reader, {splits} splits x 8 heads", reader(r0, splits))
    timed("reader 33 splits, cold", _rotating([reader(r, 33) for r in rings]))
    # Shares over the bytes moved (read + written), as the memcpy reference counts them.
    timed("copy_ moving the window's bytes", copy(r0))
    timed("copy_ moving the window's bytes, cold", _rotating([copy(r) for r in rings]))
    timed("ours", ours(r0))
    timed("ours, cold", _rotating([ours(r) for r in rings]))
    rows["profile"] = kernel_durations(ours(r0), reader(r0, 33))
    rows["flat"] = flat_decode()
    save()
    if not sweep:
        return
    defaults = (ta.RING_PROGRAMS_PER_SM, ta.RING_BLOCK_N, ta.NUM_WARPS, ta.RING_NUM_STAGES)
    rows["sweep"] = []
    try:
        for pps, bn, warps, stages in itertools.product((2, 3, 4), (32, 64), (4, 8), (2, 3)):
            ta.RING_PROGRAMS_PER_SM, ta.RING_BLOCK_N, ta.NUM_WARPS, ta.RING_NUM_STAGES = pps, bn, warps, stages
            row: Dict[str, object] = {"programs_per_sm": pps, "block_n": bn, "warps": warps, "stages": stages}
            try:
                t = graph_time(ours(r0))
                row.update(us=t * 1e6, share=kv_bytes / t / memcpy_Bps)
            except Exception as e:  # out of shared memory or registers
                row["error"] = str(e).splitlines()[0][:160]
            rows["sweep"].append(row)
            print(f"  {json.dumps(row)}", flush=True)
            save()
    finally:
        ta.RING_PROGRAMS_PER_SM, ta.RING_BLOCK_N, ta.NUM_WARPS, ta.RING_NUM_STAGES = defaults
    for r in sorted((r for r in rows["sweep"] if "us" in r), key=lambda r: r["us"])[:6]:
        print(f"sweep {json.dumps(r)}", flush=True)


def kernel_durations(ours: Callable[[], object], reader: Callable[[], object]) -> Dict[str, object]:
    """GPU time of each kernel alone (CUPTI), eager, 20 calls each: the graph's time per call less
    this is what the launches in between cost."""
    out: Dict[str, object] = {}
    for name, fn in (("ours", ours), ("reader", reader)):
        fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        per: Dict[str, List[float]] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per.setdefault(e.name[:60], []).append(e.time_range.elapsed_us())
        out[name] = {k: {"calls": len(v), "median_us": sorted(v)[len(v) // 2]} for k, v in per.items()}
        print(f"profile {name}: {json.dumps(out[name])}", flush=True)
    return out


def flat_decode() -> List[Dict[str, object]]:
    """Flat decode steps of ours at the contexts ``kernels.py`` measures, and at 4,096 (the window's bytes)."""
    from offgraph_kv.backend import triton_attention as ta

    bf = torch.bfloat16
    out = []
    for ctx in (1024, 4096, 8192, 32768, 131072):
        q, k, v, ks, vs, length, kv_bytes = decode_case(ctx, HQ, HKV, D)
        t = graph_time(lambda: ta.update_attend(q, k, v, ks, vs, length, 0, D ** -0.5, bf))
        out.append({"context": ctx, "us": t * 1e6, "share": kv_bytes / t / memcpy_Bps})
        print(f"flat {json.dumps(out[-1])}", flush=True)
    return out


def probe(calls: int) -> None:
    """Eager calls of ours and the reader, nothing else: for a profiler (ncu)."""
    from offgraph_kv.backend import triton_attention as ta

    r = _rings(1)[0]
    scratch = torch.empty(4096, device="cuda", dtype=torch.float32)
    for _ in range(calls):
        ta.update_attend(r["q"], r["k"], r["v"], r["ks"], r["vs"], r["length"], WINDOW, D ** -0.5, torch.bfloat16)
    for _ in range(calls):
        _reader[(33, HKV)](r["ks"], r["vs"], r["length"], scratch, r["ks"].stride(1), r["ks"].stride(2),
                           r["ks"].shape[1], WINDOW, 33, BLOCK_N=64, D=D, num_warps=4, num_stages=3)
    torch.cuda.synchronize()


memcpy_Bps = 0.0


def main(argv: "list[str] | None" = None) -> int:
    global memcpy_Bps
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    p.add_argument("--sweep", action="store_true", help="also time kernel variants")
    p.add_argument("--probe", type=int, help="(for a profiler) only this many eager calls of ours and the reader")
    a = p.parse_args(argv)
    if a.probe:
        probe(a.probe)
        return 0
    from benchmarks.cuda.growth import memcpy_seconds

    mc = 1 << 30
    memcpy_Bps = 2 * mc / memcpy_seconds(mc)
    print(f"memcpy {memcpy_Bps / 1e12:.2f} TB/s; window {2 * WINDOW * HKV * D * 2 / 1e6:.1f} MB "
          f"= {2 * WINDOW * HKV * D * 2 / memcpy_Bps * 1e6:.2f} us at memcpy speed", flush=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python -m benchmarks.cuda.ring_floor " + " ".join(sys.argv[1:] if argv is None else argv),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "memcpy_TBps": memcpy_Bps / 1e12, "rows": {}}

    def save() -> None:
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=2))

    measure(a.sweep, save, result["rows"])
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
