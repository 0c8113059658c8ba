"""What the runtime's safety checks cost: the code digest at load, AOTInductor's
per-run input checks at every step.

    python -m benchmarks.cpu.checks --out benchmarks/results/checks_cpu.json [--pte P.pte] [--device cuda]

1. **Integrity at load.** The runtime's own SHA-256 (``_bench.sha256_seconds``,
   the function the load runs over the code and its compiled interface) timed
   over 4 MiB and 64 MiB; its cost for every program recorded in
   ``benchmarks/results/weights_*.json`` (code bytes / throughput) as a share
   of that program's measured load time. Weights are checked with CRC-32, whose
   cost is inside those load times.
2. **Input checks per step.** The same program decoded in two child processes,
   ``OFFGRAPH_KV_AOTI_INPUT_CHECKS=1`` (the default) and ``=0``, interleaved
   over rounds (a busy machine slows both alike); median step time of each and
   their ratio. Without ``--pte`` a 16-layer toy decoder is exported first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

from benchmarks.lib.paths import LLAMA_DIR, REPO, RESULTS, use_example_model

_CHILD = r"""
import sys, time, statistics, torch
sys.path.insert(0, %(examples)r)
import offgraph_kv.runtime as ogr
from model import positions
device = sys.argv[2]
m = ogr.load_method(sys.argv[1])
prefill = torch.arange(32).unsqueeze(0) %% 100
m.execute([prefill, positions(0, 32)])
times, pos, tok = [], 32, torch.tensor([[7]])
for i in range(int(sys.argv[3])):
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = m.execute([tok, positions(pos, 1)])[0]
    if device == "cuda":
        torch.cuda.synchronize()
    times.append(time.perf_counter() - t)
    pos += 1
print(statistics.median(times[5:]) * 1e3)
"""


def digest_cost() -> Dict[str, object]:
    from offgraph_kv.runtime import _bench

    rate = {n: n / _bench.sha256_seconds(n, 3) for n in (4 << 20, 64 << 20)}
    mb_s = min(rate.values()) / 1e6
    programs = []
    for path in sorted(RESULTS.glob("weights_*.json")):
        for r in json.loads(path.read_text()).get("results", []):
            if r.get("variant") != "outside" or not r.get("code_bytes") or not r.get("run"):
                continue
            seconds = r["code_bytes"] / (mb_s * 1e6)
            programs.append({"file": path.name, "shape": r["shape"], "device": r["device"], "code_bytes": r["code_bytes"],
                             "weight_bytes": r["export"]["weight_bytes"], "load_s": r["run"]["load_s"],
                             "digest_s": seconds, "digest_share_of_load": seconds / r["run"]["load_s"]})
    return {"sha256_MB_per_s": mb_s, "programs": programs}


def export_toy(path: Path) -> None:
    use_example_model()
    import torch
    from executorch.exir import to_edge_transform_and_lower
    from model import ModelArgs, Transformer, dynamic_shapes, example_inputs, init_deterministic

    from offgraph_kv.partitioner import OffGraphKVPartitioner

    model = init_deterministic(Transformer(ModelArgs(dim=256, n_layers=16, n_heads=8, n_kv_heads=2, vocab_size=512,
                                                     multiple_of=64)), seed=0).eval()
    ep = torch.export.export(model, example_inputs(4), dynamic_shapes=dynamic_shapes(32))
    prog = to_edge_transform_and_lower(ep, partitioner=[OffGraphKVPartitioner(storage_dtype=torch.float32)])
    path.write_bytes(prog.to_executorch().buffer)


def step_cost(pte: Path, device: str, rounds: int, steps: int) -> Dict[str, object]:
    code = _CHILD % {"examples": str(LLAMA_DIR)}
    runs: Dict[str, List[float]] = {"on": [], "off": []}
    for _ in range(rounds):
        for name, flag in (("on", "1"), ("off", "0")):
            env = dict(os.environ, OFFGRAPH_KV_AOTI_INPUT_CHECKS=flag, OMP_NUM_THREADS="1")
            done = subprocess.run([sys.executable, "-c", code, str(pte), device, str(steps)], env=env,
                                  capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise RuntimeError(done.stderr[-2000:])
            runs[name].append(float(done.stdout.split()[-1]))
    on, off = statistics.median(runs["on"]), statistics.median(runs["off"])
    return {"pte": pte.name, "device": device, "rounds": rounds, "steps": steps, "step_ms_checks_on": on,
            "step_ms_checks_off": off, "on_over_off": on / off, "per_round_ms": runs}


def main(argv: "List[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--pte", type=Path, help="program to step (default: export a 16-layer toy here)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from benchmarks.lib.machine import describe, now_utc

    result: Dict[str, object] = {"date": now_utc(), "machine": describe()}
    result["digest"] = digest_cost()
    d = result["digest"]
    print(f"SHA-256 (runtime's own): {d['sha256_MB_per_s']:.0f} MB/s")
    for prog in d["programs"]:
        print(f"  {prog['shape']:>5} {prog['device']:>4}: code {prog['code_bytes'] / 1e6:.1f} MB -> "
              f"{prog['digest_s'] * 1e3:.1f} ms = {100 * prog['digest_share_of_load']:.2f} % of its {prog['load_s']:.2f} s load")
    pte = a.pte
    if pte is None:
        pte = Path(os.environ.get("TMPDIR", "/tmp")) / "offgraph_kv_checks_toy16.pte"
        if not pte.exists():
            export_toy(pte)
    s = result["steps"] = step_cost(pte, a.device, a.rounds, a.steps)
    print(f"decode step, AOTI input checks on: {s['step_ms_checks_on']:.3f} ms, off: {s['step_ms_checks_off']:.3f} ms "
          f"(on/off {s['on_over_off']:.3f}, medians of {a.rounds} interleaved rounds)")
    a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
