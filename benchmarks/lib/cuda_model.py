"""The CUDA suite's model: its shape, its export, and a runner that feeds it tokens.

Shared by every CUDA benchmark (``benchmarks/cuda/``): a 32-layer decoder with
Llama-3-8B attention shapes (32 query heads, 8 KV heads, head dim 128) on a
narrow residual stream (dim 512), bf16 weights and bf16 KV, random weights.
``SMALL`` is a 2-layer toy for a dry run of a script on CPU.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Dict, Optional

import torch

from benchmarks.lib.paths import use_example_model

use_example_model()

SHAPE = dict(dim=512, n_layers=32, n_heads=32, n_kv_heads=8, attention_head_dim=128, vocab_size=1024, hidden_dim=512)
SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, hidden_dim=64)  # --small: a CPU dry run
MAX_WRITE = 512
INITIAL_CAPACITY = 256
MIB = 2**20


def build(shape: Dict[str, int], device: str, max_capacity: int, out: Path) -> Dict[str, object]:
    from executorch.exir import to_edge_transform_and_lower
    from model import ModelArgs, Transformer, dynamic_shapes, example_inputs, init_deterministic

    from offgraph_kv.partitioner import OffGraphKVPartitioner

    t0 = time.perf_counter()
    model = init_deterministic(Transformer(ModelArgs(**shape)), seed=0).to(torch.bfloat16).eval()
    with torch.no_grad():
        ep = torch.export.export(model, example_inputs(4), dynamic_shapes=dynamic_shapes(MAX_WRITE))
    part = OffGraphKVPartitioner(device=device, storage_dtype=torch.bfloat16, max_capacity=max_capacity,
                                 initial_capacity=INITIAL_CAPACITY)
    out.write_bytes(to_edge_transform_and_lower(ep, partitioner=[part]).to_executorch().buffer)
    return {"path": str(out), "bytes": out.stat().st_size, "build_s": round(time.perf_counter() - t0, 1),
            "params": sum(p.numel() for p in model.parameters())}


def device_used(device: str) -> Optional[int]:
    if device != "cuda":
        return None
    free, total = torch.cuda.mem_get_info()
    return total - free


class Runner:
    """A loaded method, fed greedy tokens one step at a time."""

    def __init__(self, path: Path) -> None:
        import offgraph_kv.runtime as rt

        self.method = rt.load_method(path)
        self.store = rt.latest_store()
        self.length = 0

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        w = tokens.shape[1]
        pos = torch.arange(self.length, self.length + w, dtype=torch.long).unsqueeze(-1)
        logits = self.method.execute([tokens, pos])[0]
        self.length += w
        return logits

    def reset(self) -> None:
        self.store.reset(False)
        self.length = 0
