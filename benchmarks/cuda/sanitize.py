"""A generation that grows the CUDA store three times, for compute-sanitizer.

    compute-sanitizer --tool memcheck python -m benchmarks.cuda.sanitize model.pte
"""

from __future__ import annotations

import sys

import torch

import offgraph_kv.runtime as rt


def main(path: str) -> int:
    method = rt.load_method(path)  # works whichever torch the process has
    store = rt.latest_store()
    tok = torch.tensor([[1, 2, 3]])
    length = 0
    while store.metrics()["growths"] < 3 or length < 40:
        w = tok.shape[1]
        logits = method.execute([tok, torch.arange(length, length + w).unsqueeze(-1)])[0]
        length += w
        tok = logits[:, -1:].argmax(-1)
    m = store.metrics()
    print(f"length {m['length']} capacity {m['capacity']} growths {m['growths']}")
    return 0 if m["growths"] >= 3 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
