"""Generations for compute-sanitizer: growths, ring wraps and replayed CUDA graphs.

    compute-sanitizer --tool memcheck python -m benchmarks.cuda.sanitize model.pte
    python -m benchmarks.cuda.sanitize --build kernels.pte     # bf16 ring(6) / flat / ring(16), our Triton kernels
    compute-sanitizer --tool racecheck python -m benchmarks.cuda.sanitize kernels.pte

A program whose attention reads the length from device memory (our Triton
kernels) is run twice, with CUDA graphs on and off, so the sanitizer sees the
kernels both launched by the compiled code and replayed from a captured graph;
map growth keeps one capture across the growths, copy growth recaptures after
each. A 32-token prompt chunk takes the wide kernel variant; chunks of 8
straddle the rings' wraps; a 3-token step between
decode steps runs uncaptured. Exits non-zero when the run did not grow three
times or (with graphs) never replayed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

import offgraph_kv.runtime as rt

REPO = Path(__file__).resolve().parents[2]


def build(out: Path, device: str = "cuda") -> None:
    """Export a small bf16 model with ring(6), flat and ring(16) layers (on CUDA: our kernels)."""
    sys.path.insert(0, str(REPO / "examples" / "llama"))
    from executorch.exir import to_edge_transform_and_lower
    from executorch.extension.llm.cache.reference_cache import LayerPolicy
    from model import ModelArgs, Transformer, dynamic_shapes, example_inputs, init_deterministic

    from offgraph_kv.partitioner import OffGraphKVPartitioner

    args = ModelArgs(dim=128, n_layers=3, n_heads=8, n_kv_heads=2, vocab_size=256, multiple_of=32)
    model = init_deterministic(Transformer(args), seed=0).eval()
    with torch.no_grad():
        ep = torch.export.export(model, example_inputs(4), dynamic_shapes=dynamic_shapes(32))
    part = OffGraphKVPartitioner(device=device, storage_dtype=torch.bfloat16, initial_capacity=8, max_write=32,
                                 layers=(LayerPolicy.ring(6), LayerPolicy.flat(), LayerPolicy.ring(16)))
    out.write_bytes(to_edge_transform_and_lower(ep, partitioner=[part]).to_executorch().buffer)
    print(f"built {out} ({out.stat().st_size} bytes; Triton kernels: {b'_update_attend_partial' in out.read_bytes()})")


def generate(path: str, graphs: bool, growth: str) -> Dict[str, int]:
    rt.configure(cuda_graphs=graphs, growth=growth)
    try:
        method = rt.load_method(path)  # works whichever torch the process has
    finally:
        rt.configure()
    store = rt.latest_store()
    gen = torch.Generator().manual_seed(0)
    length, decode = 0, 0
    for w in (32, 8, 8, 8):  # a wide prompt chunk (128 folded query rows: the wide kernel), then chunks across wraps
        tok = torch.randint(0, 200, (1, w), generator=gen)
        logits = method.execute([tok, torch.arange(length, length + w).unsqueeze(-1)])[0]
        length += w
    tok = logits[:, -1:].argmax(-1)
    while store.metrics()["growths"] < 4 or decode < 60:
        if decode == 30:  # a wider step between decode steps
            tok = torch.cat([tok, tok, tok], 1)
        w = tok.shape[1]
        logits = method.execute([tok, torch.arange(length, length + w).unsqueeze(-1)])[0]
        if not torch.isfinite(logits).all():
            raise RuntimeError(f"non-finite logits at length {length}")
        length += w
        decode += 1
        tok = logits[:, -1:].argmax(-1)
    m = store.metrics()
    print(f"graphs {'on ' if graphs else 'off'} growth {m['growth']}: length {m['length']} capacity {m['capacity']} "
          f"growths {m['growths']} captures {m['graph_captures']} replays {m['graph_replays']}", flush=True)
    return m


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pte", help="the program to run (with --build: where to write it)")
    ap.add_argument("--build", action="store_true", help="export the mixed ring/flat bf16 program to PTE and stop")
    ap.add_argument("--device", default="cuda", help="with --build: the program's device")
    ap.add_argument("--growth", choices=("map", "copy"), default="map")
    ap.add_argument("--expect-graphs", action="store_true", help="fail unless decode steps were captured and replayed")
    a = ap.parse_args(argv)
    if a.build:
        build(Path(a.pte), a.device)
        return 0
    ok = True
    for graphs in (True, False):
        m = generate(a.pte, graphs, a.growth)
        ok &= m["growths"] >= 3
        if graphs and a.expect_graphs:
            ok &= m["graph_captures"] > 0 and m["graph_replays"] > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
