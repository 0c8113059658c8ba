"""Build the programs the CPU benchmark compares, all from the same weights.

    python -m benchmarks.lib.artifacts --kind offgraph --capacity 8192 --workdir W --out W/offgraph_8192.pte

Kinds:

- ``stock``: ExecuTorch's own llama export (``executorch.examples.models.llama.
  export_llama``) with a static KV cache, ``use_sdpa_with_kv_cache`` and XNNPACK,
  from a Meta-format checkpoint + params.json of the same weights.
- ``static-mask`` / ``static-prefix``: the example llama with in-graph static KV
  buffers (``static_cache.py``), torch.export + ``torch._inductor.aot_compile``.
- ``offgraph``: the example llama lowered with ``OffGraphKVPartitioner``.

Each build runs in its own process (the parent runs two at a time) and writes
``<out>.build.json`` next to the artifact: path, bytes, build seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict

import torch

from benchmarks.lib.paths import use_example_model

use_example_model()

from model import ModelArgs, Transformer, dynamic_shapes, example_inputs, init_deterministic  # noqa: E402

KINDS = ("stock", "static-mask", "static-prefix", "offgraph")

# The DESIGN's toy shape; fp32 weights.
MODEL_SHAPE = dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, vocab_size=512)
SEED = 0


def model_args() -> ModelArgs:
    return ModelArgs(**MODEL_SHAPE)


def kv_bytes_per_token(args: ModelArgs, storage_bytes: int = 4) -> int:
    """K and V bytes one more token adds, all layers (every layer is flat here)."""
    return 2 * args.n_layers * args.n_kv_heads * args.head_dim * storage_bytes


def write_weights(workdir: Path) -> Dict[str, str]:
    """The deterministic model's weights, once: a state_dict for our builders and a
    Meta checkpoint + params.json (q/k permuted to Meta's interleaved RoPE layout)
    for ExecuTorch's own export."""
    from checkpoint import to_meta_state_dict

    workdir.mkdir(parents=True, exist_ok=True)
    args = model_args()
    model = init_deterministic(Transformer(args), seed=SEED).eval()
    state = workdir / "weights.pt"
    torch.save(model.state_dict(), state)
    meta = workdir / "consolidated.00.pth"
    torch.save(to_meta_state_dict(model), meta)
    params = workdir / "params.json"
    params.write_text(json.dumps({
        "dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
        "vocab_size": args.vocab_size, "hidden_dim": args.ffn_hidden, "multiple_of": args.multiple_of,
        "norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
    }, indent=2))
    return {"state_dict": str(state), "meta_checkpoint": str(meta), "params": str(params)}


def load_model(workdir: Path) -> Transformer:
    model = Transformer(model_args())
    model.load_state_dict(torch.load(workdir / "weights.pt", weights_only=True))
    return model.eval()


def build_stock(workdir: Path, capacity: int, max_write: int, out: Path) -> Dict[str, object]:
    # max_seq_length bounds the tokens of one call (the stock export accepts max_seq_length - 1);
    # max_context_length is the KV cache capacity.
    seq = min(capacity, max_write)
    cmd = [
        sys.executable, "-m", "executorch.examples.models.llama.export_llama",
        "--checkpoint", str(workdir / "consolidated.00.pth"), "--params", str(workdir / "params.json"),
        "-kv", "--use_sdpa_with_kv_cache", "-X", "-d", "fp32",
        "--max_seq_length", str(seq), "--max_context_length", str(capacity),
        "--output-dir", str(out.parent), "--output_name", out.name,
    ]
    log = out.with_suffix(".export.log")
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=workdir, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"export_llama failed (rc {r.returncode}); see {log}")
    return {"command": " ".join(cmd[1:]), "max_seq_length": seq, "max_context_length": capacity}


def build_static(workdir: Path, capacity: int, max_write: int, attend: str, out: Path) -> Dict[str, object]:
    from benchmarks.lib.static_cache import static_cache_model

    model = static_cache_model(load_model(workdir), capacity, attend)
    example = example_inputs(4)
    with torch.no_grad():
        ep = torch.export.export(model, example, dynamic_shapes=dynamic_shapes(max_write))
        so = torch._inductor.aot_compile(ep.module(), example, options={"aot_inductor.package": False})
    os.replace(so, out)  # the wrapper .so is self-contained (weights and cache buffers inside)
    return {"attend": attend, "max_write": max_write}


def build_offgraph(workdir: Path, capacity: int, max_write: int, out: Path) -> Dict[str, object]:
    from executorch.exir import to_edge_transform_and_lower

    from offgraph_kv.partitioner import OffGraphKVPartitioner

    model = load_model(workdir)
    with torch.no_grad():
        ep = torch.export.export(model, example_inputs(4), dynamic_shapes=dynamic_shapes(max_write))
    part = OffGraphKVPartitioner(storage_dtype=torch.float32, max_capacity=capacity, initial_capacity=256)
    prog = to_edge_transform_and_lower(ep, partitioner=[part]).to_executorch()
    data = prog.buffer
    out.write_bytes(data)
    info: Dict[str, object] = {"storage_dtype": "fp32", "initial_capacity": 256, "max_write": max_write}
    try:  # where the bytes go (manifest vs compiled code + weights); export.py knows how to read it
        from export import scan_pte

        info["pte_scan"] = scan_pte(data)
    except Exception as e:  # noqa: BLE001 - informational only
        info["pte_scan_error"] = repr(e)
    return info


def build(kind: str, workdir: Path, capacity: int, max_write: int, out: Path) -> Dict[str, object]:
    t0 = time.perf_counter()
    if kind == "stock":
        info = build_stock(workdir, capacity, max_write, out)
    elif kind.startswith("static-"):
        info = build_static(workdir, capacity, max_write, kind.split("-", 1)[1], out)
    elif kind == "offgraph":
        info = build_offgraph(workdir, capacity, max_write, out)
    else:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    info.update(kind=kind, capacity=capacity, path=str(out), bytes=out.stat().st_size,
                build_s=round(time.perf_counter() - t0, 2))
    return info


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=KINDS, required=True)
    p.add_argument("--capacity", type=int, required=True)
    p.add_argument("--max-write", type=int, default=512)
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    out = Path(a.out)
    info = build(a.kind, Path(a.workdir), a.capacity, a.max_write, out)
    Path(str(out) + ".build.json").write_text(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
