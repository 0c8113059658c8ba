"""Where a CUDA decode step's time goes: kernels per step and GPU-busy time vs wall time.

    python -m benchmarks.cuda.profile --layers 4 --out results/cuda_profile_h200.json

Builds the H200 suite's model (benchmarks/cuda/suite.py) with fewer layers, decodes
to ``--context`` tokens, then profiles ``--steps`` decode steps with CUPTI
(torch.profiler sees every kernel of the process, whoever launches it: here
the AOTI code inside the ExecuTorch delegate). A step whose GPU-busy time is
well under its wall time is bound by launching, not by memory bandwidth.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def main(argv: "list[str] | None" = None) -> int:
    from benchmarks.lib.cuda_model import SHAPE, Runner, build

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--workdir", default="/tmp/offgraph_cuda_profile")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    shape = dict(SHAPE, n_layers=a.layers)
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    info = build(shape, "cuda", 1 << (a.context + a.steps).bit_length(), Path(a.workdir) / "profile.pte")
    runner = Runner(Path(info["path"]))
    tok = torch.tensor([[1]], dtype=torch.long)
    for _ in range(a.context):
        tok = runner.step(tok)[:, -1:].argmax(-1)
    walls = []
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(a.steps):
            t0 = time.perf_counter()
            tok = runner.step(tok)[:, -1:].argmax(-1)
            walls.append(time.perf_counter() - t0)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: "collections.Counter[str]" = collections.Counter()
    busy_us = 0.0
    for e in kernels:
        us = e.time_range.elapsed_us()
        busy_us += us
        by_name[e.name[:80]] += us
    wall_ms = statistics.median(walls) * 1e3
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.cuda.profile " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name(), "model": shape, "context": a.context, "steps": a.steps,
        "wall_ms_per_step": wall_ms, "kernels_per_step": len(kernels) / a.steps,
        "kernels_per_layer": len(kernels) / a.steps / a.layers,
        "gpu_busy_ms_per_step": busy_us / a.steps / 1e3,
        "gpu_busy_share_of_wall": busy_us / a.steps / 1e3 / wall_ms,
        "top_kernels_us_per_step": {k: v / a.steps for k, v in by_name.most_common(12)},
    }
    print(json.dumps({k: v for k, v in result.items() if k != "top_kernels_us_per_step"}, indent=1))
    Path(a.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
