"""Kernel variants side by side in one process (H200, seventh session), timed as kernels.py times ours.

    python benchmarks/results/raw/h200_2026-12-02_s7/variants/compare.py OUT.json

v0: the committed kernels before this session (HEAD); v1: positions relative to the
length in int32, one 64-bit base per key block, the write in 16-token tiles;
v2: v0 with only v1's write tiles; v1_pps3_bn32_s2: v1 with the ring sweep's best
narrow configuration. Each variant is imported from its file under its own op name.
Two rounds, variants interleaved, to show the run-to-run spread.
"""

import importlib.util
import json
import sys
from pathlib import Path

import torch

from benchmarks.cuda.kernels import graph_time

HERE = Path(__file__).resolve().parent


def load(name):
    src = (HERE / f"{name}.py").read_text().replace('"offgraph_kv::update_attend"', f'"offgraph_kv::update_attend_{name}"')
    path = Path(f"/tmp/ta_{name}.py")
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"ta_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    hq, hkv, d, bf = 32, 8, 128, torch.bfloat16
    scale = d ** -0.5
    mods = {n: load(n) for n in ("v0_head", "v1_relative_int32", "v2_write_tile_only")}
    variants = [("v0", mods["v0_head"], {}), ("v1", mods["v1_relative_int32"], {}),
                ("v2", mods["v2_write_tile_only"], {}),
                ("v1_pps3_bn32_s2", mods["v1_relative_int32"], dict(PROGRAMS_PER_SM=3, BLOCK_N=32, NUM_STAGES=2))]
    cases = {}
    slots = 4096 + 511
    ks = torch.randn(1, slots, hkv, d, device="cuda", dtype=bf)
    cases["ring 4096"] = dict(q=torch.randn(1, hq, 1, d, device="cuda", dtype=bf), k=torch.randn(1, hkv, 1, d, device="cuda", dtype=bf),
                              v=torch.randn(1, hkv, 1, d, device="cuda", dtype=bf), ks=ks, vs=torch.randn_like(ks),
                              length=torch.tensor([100_003], device="cuda"), window=4096)
    for ctx in (8192, 32768, 131072):
        ks = torch.randn(1, ctx + 1, hkv, d, device="cuda", dtype=bf)
        cases[f"decode {ctx}"] = dict(q=torch.randn(1, hq, 1, d, device="cuda", dtype=bf), k=torch.randn(1, hkv, 1, d, device="cuda", dtype=bf),
                                     v=torch.randn(1, hkv, 1, d, device="cuda", dtype=bf), ks=ks, vs=torch.randn_like(ks),
                                     length=torch.tensor([ctx], device="cuda"), window=0)
    for ctx in (0, 4096):
        ks = torch.randn(1, ctx + 512, hkv, d, device="cuda", dtype=bf)
        cases[f"prefill 512 at {ctx}"] = dict(q=torch.randn(1, hq, 512, d, device="cuda", dtype=bf),
                                             k=torch.randn(1, hkv, 512, d, device="cuda", dtype=bf),
                                             v=torch.randn(1, hkv, 512, d, device="cuda", dtype=bf), ks=ks,
                                             vs=torch.randn_like(ks), length=torch.tensor([ctx], device="cuda"), window=0)
    out = {"device": torch.cuda.get_device_name(), "rounds": []}
    for rnd in range(2):
        table = {}
        for name, mod, over in variants:
            saved = {k: getattr(mod, k) for k in over}
            for k, v in over.items():
                setattr(mod, k, v)
            try:
                for case, c in cases.items():
                    reps = 5 if case.startswith("prefill") else 20
                    t = graph_time(lambda: mod.update_attend(c["q"], c["k"], c["v"], c["ks"], c["vs"], c["length"],
                                                             c["window"], scale, bf), reps=reps)
                    table.setdefault(case, {})[name] = t * 1e6
            finally:
                for k, v in saved.items():
                    setattr(mod, k, v)
        out["rounds"].append(table)
        for case, row in table.items():
            print(f"round {rnd} {case:22s} " + "  ".join(f"{n} {us:7.2f}" for n, us in row.items()), flush=True)
    Path(sys.argv[1]).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
