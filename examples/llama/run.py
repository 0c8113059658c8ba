"""Generate text with a .pte from export.py; the KV cache lives in the offgraph-kv delegate.

    python examples/llama/run.py smollm2.pte --chat --prompt "What is the capital of France?"
    python examples/llama/run.py toy.pte --prompt "Once upon a time" --max-new-tokens 64
    python examples/llama/run.py m.pte --prompt "Hi" --chat --temperature 0.7 --top-p 0.9 --json out.json

Prefill is chunked into steps of at most ``max_write`` tokens (from the sidecar
export.py wrote), since that is the widest step the compiled code accepts.
Before every step the remaining capacity (``max_capacity - length``) is checked,
so running out of cache ends generation with a message instead of an error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

import torch  # noqa: E402

from json_files import json_field, read_json_object  # noqa: E402
from model import ModelArgs, Transformer, init_deterministic, positions  # noqa: E402
from report import format_bytes  # noqa: E402
from tokenizer import Tokenizer, load_tokenizer  # noqa: E402

from offgraph_kv.schemas.manifest import dtype_from_name  # noqa: E402



def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pte", help=".pte written by export.py (its sidecar <pte>.json must be next to it)")
    p.add_argument("--prompt", help="prompt text (default: 'Once upon a time'; with --chat and no prompt: an "
                                     "interactive chat on stdin with /undo, /regen, /save FILE, /quit)")
    p.add_argument("--tokenizer", help="tokenizer.json / tokenizer.model (default: the one in the sidecar, else bytes)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--resume", help="interactive chat: continue a conversation saved with /save (no re-prefill)")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--no-bos", action="store_true", help="do not prepend BOS to a plain prompt")
    p.add_argument("--ignore-stop", action="store_true", help="keep generating through stop tokens")
    p.add_argument("--initial-capacity", type=int, help="run-time override of the export's initial capacity")
    p.add_argument("--max-capacity", type=int, help="run-time override of the export's max capacity")
    p.add_argument("--check", action="store_true",
                   help="also run the eager model with ExecuTorch's reference cache and report the largest logit gap")
    p.add_argument("--json", help="write prompt/generated ids, text, timings and final metrics here")
    p.add_argument("--quiet", action="store_true", help="do not stream text to stdout")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per step of the compiled code (the runtime's num_threads; default: one for "
                        "decode steps, which are memory-bound and on a busy machine a second OpenMP thread made "
                        "SmolLM2 decode 9x slower; the cores no other process is running on for prefill chunks)")
    return p.parse_args(argv)


def read_sidecar(pte: "str | Path") -> Dict[str, object]:
    path = Path(str(pte) + ".json")
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run.py needs the sidecar export.py writes next to the .pte")
    side = read_json_object(path)
    max_write, args = side.get("max_write"), side.get("model_args")
    if not isinstance(max_write, int) or isinstance(max_write, bool) or max_write < 1:
        raise ValueError(f"{path}: 'max_write' must be a positive integer, got {max_write!r}")
    if not isinstance(args, dict) or not isinstance(args.get("vocab_size"), int) or args["vocab_size"] < 1:
        raise ValueError(f"{path}: 'model_args' must be an object with a positive integer 'vocab_size'")
    model_args_from_json(args, f"{path} model_args")  # typed now: --check builds a model from them
    # The tokenizer entry steers which file is read and which ids stop generation.
    tok = json_field(side, "tokenizer", "object", str(path), {})
    for key in ("path", "kind"):
        json_field(tok, key, "str", f"{path} tokenizer", None)
    for i in json_field(tok, "stop_ids", "int_or_ints", f"{path} tokenizer", []) or []:
        if not 0 <= i < args["vocab_size"]:
            raise ValueError(f"{path}: tokenizer stop id {i} is outside the model's vocabulary of {args['vocab_size']}")
    return side


# ModelArgs' fields and the JSON kind each is written as (export.py writes ``asdict``).
_MODEL_ARG_KINDS = {
    "dim": "int", "n_layers": "int", "n_heads": "int", "n_kv_heads": "int", "vocab_size": "int", "hidden_dim": "int",
    "multiple_of": "int", "ffn_dim_multiplier": "number", "norm_eps": "number", "rope_theta": "number",
    "rope_scaling": "object", "sliding_windows": "int_or_ints", "tie_embeddings": "bool", "attention_head_dim": "int",
    "qkv_bias": "bool", "out_bias": "bool", "mlp_bias": "bool", "qk_norm": "bool", "full_logits": "bool",
    "norm_offset": "bool", "embed_scale": "bool", "mlp_act": "str", "sandwich_norms": "bool",
    "attention_scale": "number", "local_rope_theta": "number", "final_logit_softcap": "number",
    "embedding_multiplier": "number", "residual_multiplier": "number", "logits_scaling": "number",
    "nope_layers": "int_or_ints", "qk_norm_full": "bool", "pre_norms": "bool", "norm_fp32_weight": "bool",
}
# Fields whose null means "none" (the others' null takes ModelArgs' default).
_NULLABLE_MODEL_ARGS = ("hidden_dim", "ffn_dim_multiplier", "rope_scaling", "attention_head_dim", "attention_scale",
                        "local_rope_theta", "final_logit_softcap", "embedding_multiplier",
                        "residual_multiplier", "logits_scaling")


def model_args_from_json(values: Dict[str, object], where: str) -> ModelArgs:
    """ModelArgs from a sidecar's ``model_args``: known fields only, each of its JSON kind, then the
    loaders' own sanity checks (ModelArgs(**...) took any key and any type, unchecked)."""
    from checkpoint import check_args

    unknown = sorted(set(values) - set(_MODEL_ARG_KINDS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}")
    typed = {k: json_field(values, k, kind, where, None) for k, kind in _MODEL_ARG_KINDS.items() if k in values}
    for key in ("sliding_windows", "nope_layers"):
        if isinstance(typed.get(key), int):
            raise ValueError(f"{where}: {key!r} must be a list of integers")
    args = ModelArgs(**{k: v for k, v in typed.items() if v is not None or k in _NULLABLE_MODEL_ARGS})
    check_args(args, where)
    return args


# --------------------------------------------------------------------------- #
# Sampling
# --------------------------------------------------------------------------- #


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    """Greedy at temperature 0, else nucleus sampling over the softmax at ``temperature``."""
    if temperature <= 0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_p, order = torch.sort(probs, descending=True)
    # Keep the smallest prefix whose mass reaches top_p (always at least one token).
    keep = (torch.cumsum(sorted_p, dim=-1) - sorted_p) < top_p
    sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)
    return int(order[choice].item())


class TextStream:
    """Prints the text of the generated ids as it grows.

    Decoding the whole sequence and printing the new suffix handles tokens that
    split a UTF-8 character (held back while the text ends in U+FFFD) and
    tokenizers whose pieces depend on their neighbours.
    """

    def __init__(self, tok: Tokenizer, enabled: bool) -> None:
        self.tok, self.enabled = tok, enabled
        self.ids: List[int] = []
        self.printed = 0

    @staticmethod
    def _clean(text: str) -> str:
        # A toy model emits arbitrary bytes; keep control characters off the terminal.
        return "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in text)

    def push(self, token: int) -> None:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        self._emit(text)

    def _emit(self, text: str) -> None:
        if self.enabled and len(text) > self.printed:
            sys.stdout.write(self._clean(text[self.printed:]))
            sys.stdout.flush()
        self.printed = max(self.printed, len(text))

    def finish(self) -> str:
        text = self.tok.decode(self.ids)
        self._emit(text)
        if self.enabled:
            sys.stdout.write("\n")
            sys.stdout.flush()
        return text


# --------------------------------------------------------------------------- #
# Eager reference (--check)
# --------------------------------------------------------------------------- #


def build_eager_reference(sidecar: Dict[str, object]) -> Transformer:
    """The eager model the .pte was exported from, rebuilt from the sidecar."""
    where = "the sidecar"
    args = model_args_from_json(sidecar["model_args"], f"{where}'s model_args")  # type: ignore[arg-type]
    source = json_field(sidecar, "source", "object", where)
    dtype = dtype_from_name(json_field(sidecar, "weights_dtype", "str", where), what="weights_dtype")
    if json_field(source, "format", "str", f"{where}'s source") == "deterministic":
        seed = json_field(source, "seed", "int", f"{where}'s source")
        model = init_deterministic(Transformer(args), seed=seed).to(dtype).eval()
    else:
        from checkpoint import load_from_source

        model = load_from_source(source, dtype).model
    # The program returns every token's logits or the last one's, as its model did.
    model.args.full_logits = bool(sidecar["model_args"].get("full_logits", True))
    q = json_field(sidecar, "quantize", "object", where, None)
    if q:  # the same torchao quantization the export applied, run by torchao's own tensors
        from quantize import DEFAULT_GROUP_SIZE, quantize_model

        quantize_model(model, json_field(q, "scheme", "str", f"{where}'s quantize"),
                       json_field(q, "group_size", "int", f"{where}'s quantize", None) or DEFAULT_GROUP_SIZE,
                       torchao_only=True)
    return model


class EagerCheck:
    """Runs the eager model step by step beside the .pte, on ExecuTorch's reference cache."""

    def __init__(self, sidecar: Dict[str, object], capacity: int) -> None:
        from executorch.extension.llm.cache.reference_cache import CacheConfig, ContiguousReferenceCache
        from executorch.extension.llm.cache.update_and_attend import REGISTRY

        self.model = build_eager_reference(sidecar)
        args = self.model.args
        self.registry = REGISTRY
        self.key = f"offgraph-kv-run-check-{id(self)}"
        with warnings.catch_warnings():  # the reference cache is marked experimental upstream
            warnings.simplefilter("ignore")
            REGISTRY.install(self.key, ContiguousReferenceCache(CacheConfig(
                n_layers=args.n_layers, n_kv_heads=args.n_kv_heads, head_dim=args.head_dim, capacity=capacity,
                dtype=dtype_from_name(json_field(sidecar, "storage_dtype", "str", "the sidecar")),
                layers=args.layer_policies())))
        self.max_abs_diff = 0.0
        self.argmax_mismatches = 0

    def step(self, tokens: torch.Tensor, pos: torch.Tensor, logits: torch.Tensor) -> None:
        with torch.no_grad(), self.registry.active(self.key):
            ref = self.model(tokens, pos)
        self.max_abs_diff = max(self.max_abs_diff, (ref - logits).abs().max().item())
        self.argmax_mismatches += int((ref.argmax(-1) != logits.argmax(-1)).sum().item())

    def close(self) -> None:
        self.registry.uninstall(self.key)


# --------------------------------------------------------------------------- #
# Generation
# --------------------------------------------------------------------------- #


@dataclass
class Generation:
    prompt_ids: List[int]
    generated_ids: List[int] = field(default_factory=list)
    stop_reason: str = ""
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    # From the first prefill step to the first new token shown (what a user waits for).
    first_token_s: float = 0.0
    message: str = ""


class CapacityExhausted(Exception):
    pass


def generate(
    method: object,
    store: object,
    prompt_ids: Sequence[int],
    max_write: int,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    pick: Callable[[torch.Tensor], int],
    on_token: Callable[[int], None] = lambda t: None,
    check: Optional[EagerCheck] = None,
) -> Generation:
    """Chunked prefill, then one token per step until a stop token, the budget or the capacity ends it."""
    g = Generation(prompt_ids=list(prompt_ids))
    pos = int(store.metrics()["length"])  # a conversation continues where the store is

    def step(ids: Sequence[int]) -> torch.Tensor:
        nonlocal pos
        m = store.metrics()
        remaining = int(m["max_capacity"]) - int(m["length"])
        if len(ids) > remaining:
            raise CapacityExhausted(
                f"the KV cache is full: {m['length']} of max {m['max_capacity']} positions used, "
                f"a step of {len(ids)} would not fit"
            )
        tokens = torch.tensor([list(ids)], dtype=torch.long)
        p = positions(pos, len(ids))
        logits = method.execute([tokens, p])[0]
        if check is not None:
            check.step(tokens, p, logits)
        pos += len(ids)
        return logits

    m = store.metrics()
    room = int(m["max_capacity"]) - int(m["length"])
    if len(prompt_ids) > room:
        g.stop_reason = "capacity"
        g.message = (f"the prompt has {len(prompt_ids)} tokens but the KV cache has room for {room} "
                     f"(max capacity {m['max_capacity']}); raise --max-capacity or shorten the prompt")
        return g
    t0 = start = time.perf_counter()
    try:
        logits = None
        for i in range(0, len(prompt_ids), max_write):
            logits = step(prompt_ids[i:i + max_write])
    except CapacityExhausted as e:
        g.stop_reason, g.message = "capacity", f"prompt does not fit: {e}"
        g.prefill_s = time.perf_counter() - t0
        return g
    g.prefill_s = time.perf_counter() - t0
    stops = set(stop_ids)

    t0 = time.perf_counter()
    while True:
        if len(g.generated_ids) >= max_new_tokens:
            g.stop_reason = "max_new_tokens"
            break
        token = pick(logits[0, -1])
        g.generated_ids.append(token)
        on_token(token)
        if len(g.generated_ids) == 1:
            g.first_token_s = time.perf_counter() - start
        if token in stops:
            g.stop_reason = "stop_token"
            break
        if len(g.generated_ids) >= max_new_tokens:
            g.stop_reason = "max_new_tokens"
            break
        try:
            logits = step([token])
        except CapacityExhausted as e:
            g.stop_reason, g.message = "capacity", f"stopped after {len(g.generated_ids)} new tokens: {e}"
            break
        g.decode_steps += 1
    g.decode_s = time.perf_counter() - t0
    return g


def memory_table(m: Dict[str, object]) -> str:
    lines = [
        "memory (offgraph-kv store)",
        f"  length      {m['length']} positions",
        f"  capacity    {m['capacity']} rows (initial {m['initial_capacity']}, max {m['max_capacity']}, "
        f"growth x{m['growth_factor']})",
        f"  allocated   {format_bytes(m['allocated_bytes'])} (peak {format_bytes(m['peak_bytes'])})",
        f"  growths     {m['growths']}",
        f"  storage     {m['storage_dtype']}",
        "  layers  kind  window      rows  bytes each",
    ]
    # Consecutive layers in the same state share a line (30 identical rows say nothing).
    groups: List[List[Dict[str, object]]] = []
    for layer in m.get("layers", []):
        same = ("kind", "window", "rows", "bytes")
        if groups and all(groups[-1][-1].get(k) == layer.get(k) for k in same):
            groups[-1].append(layer)
        else:
            groups.append([layer])
    for g in groups:
        first, last = g[0]["layer"], g[-1]["layer"]
        span = f"{first}" if first == last else f"{first}-{last}"
        window = g[0].get("window") or "-"
        lines.append(f"  {span:>6}  {g[0]['kind']:<4}  {window!s:>6}  {g[0]['rows']:>8}  "
                     f"{format_bytes(g[0]['bytes']):>10}")
    return "\n".join(lines)


def _rate(n: int, s: float) -> str:
    return f"{n / s:.1f} tok/s" if s > 0 and n > 0 else "-"


def main(argv: Optional[List[str]] = None) -> int:
    a = parse_args(argv)
    try:
        sidecar = read_sidecar(a.pte)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.max_new_tokens < 0:
        print("error: --max-new-tokens must be >= 0", file=sys.stderr)
        return 2
    if not (math.isfinite(a.temperature) and a.temperature >= 0):
        print(f"error: --temperature must be a finite number >= 0 (0 = greedy), got {a.temperature}", file=sys.stderr)
        return 2
    if not 0 < a.top_p <= 1:
        print(f"error: --top-p must be in (0, 1], got {a.top_p}", file=sys.stderr)
        return 2
    for flag, text in (("--prompt", a.prompt), ("--system", a.system)):
        try:
            if text is not None:
                text.encode("utf-8")
        except UnicodeEncodeError:  # undecodable bytes in argv arrive as lone surrogates
            print(f"error: {flag} is not valid UTF-8", file=sys.stderr)
            return 2

    if a.threads is not None and a.threads < 1:
        print("error: --threads must be >= 1", file=sys.stderr)
        return 2
    # The compiled code's threads are the runtime's (num_threads, set per step
    # and undone after); the host's own torch work (the eager --check) keeps the
    # process's setting.
    return _generate_main(a, sidecar)


def _generate_main(a: argparse.Namespace, sidecar: Dict[str, object]) -> int:
    import offgraph_kv.runtime as rt

    tok_info = sidecar.get("tokenizer") or {}
    tok_path = a.tokenizer or tok_info.get("path")
    beside = Path(str(a.pte) + ".tokenizer") / "tokenizer.json"  # a GGUF's, converted by export.py
    if not a.tokenizer and tok_path and not Path(tok_path).exists() and beside.is_file():
        tok_path = str(beside)  # the .pte and its tokenizer were moved together
    if tok_path is None and tok_info.get("kind") is None:
        print("error: the export recorded no tokenizer for this checkpoint; pass --tokenizer", file=sys.stderr)
        return 2
    try:
        tok = load_tokenizer(tok_path)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json and (Path(a.json).is_dir() or not Path(a.json).parent.is_dir()):
        print(f"error: --json {a.json}: its directory does not exist or it is a directory", file=sys.stderr)
        return 2
    if a.chat and a.prompt is None:
        from chat import interactive_chat

        return interactive_chat(a, sidecar, tok, tok_info)
    if a.resume:
        print("error: --resume continues an interactive chat (--chat without --prompt)", file=sys.stderr)
        return 2
    if a.prompt is None:
        a.prompt = "Once upon a time"
    if a.chat:
        prompt_ids = tok.chat_prompt(a.prompt, a.system)
    else:
        prompt_ids = tok.encode(a.prompt, bos=not a.no_bos)
    vocab = int(sidecar["model_args"]["vocab_size"])
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        print(f"error: prompt token {bad[0]} is outside the model's vocabulary of {vocab}", file=sys.stderr)
        return 2
    if not prompt_ids:
        print("error: the prompt encodes to no tokens", file=sys.stderr)
        return 2
    # Stop on the tokenizer's stops and the checkpoint's own (from the export).
    stop_ids = [] if a.ignore_stop else sorted(set(tok.stop_ids()) | set(tok_info.get("stop_ids") or []))

    # Always configure: None restores the export default, so an earlier
    # in-process run's overrides do not leak into this one.
    t_load = time.perf_counter()
    try:
        rt.configure(initial_capacity=a.initial_capacity, max_capacity=a.max_capacity, num_threads=a.threads)
        before = len(rt.stores())
        # executorch.runtime, or ExecuTorch's C++ Module under another torch (a CUDA image's).
        method = rt.load_method(a.pte)
        if len(rt.stores()) == before:
            raise ValueError(f"{a.pte} holds no offgraph-kv method (export it with examples/llama/export.py)")
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        rt.configure()
    load_s = time.perf_counter() - t_load
    store = rt.stores()[-1]
    max_write = int(sidecar["max_write"])

    check = None
    if a.check:
        cap = int(store.metrics()["max_capacity"])
        try:  # the sidecar's source and dtypes, and the checkpoint they name, are read only here
            check = EagerCheck(sidecar, capacity=min(cap, len(prompt_ids) + a.max_new_tokens + 1))
        except (ValueError, FileNotFoundError) as e:
            print(f"error: --check: {e}", file=sys.stderr)
            return 2
    gen = torch.Generator().manual_seed(a.seed)
    stream = TextStream(tok, enabled=not a.quiet)
    if not a.quiet:
        sys.stdout.write(a.prompt if not a.chat else f"[chat] {a.prompt}\n")
        sys.stdout.flush()
    try:
        g = generate(method, store, prompt_ids, max_write, a.max_new_tokens, stop_ids,
                     pick=lambda logits: sample(logits, a.temperature, a.top_p, gen),
                     on_token=stream.push, check=check)
    finally:
        if check is not None:
            check.close()
    text = stream.finish()
    metrics = store.metrics()

    if g.message:
        print(f"note: {g.message}", file=sys.stderr)
    n_new = len(g.generated_ids)
    # A prompt refused before any step ran has no timings to show; the note says why.
    refused = g.stop_reason == "capacity" and g.prefill_s == 0
    if not refused:
        print(f"prefill  {len(prompt_ids)} tokens in {g.prefill_s * 1e3:.1f} ms "
              f"({_rate(len(prompt_ids), g.prefill_s)}, chunks of <= {max_write})", file=sys.stderr)
        print(f"decode   {n_new} new tokens, {g.decode_steps} steps in {g.decode_s * 1e3:.1f} ms "
              f"({_rate(g.decode_steps, g.decode_s)}); stopped: {g.stop_reason}", file=sys.stderr)
        export_s = sum((sidecar.get("timings_s") or {}).values())
        print(f"speed    export {export_s:.1f} s, load {load_s:.2f} s, first token {g.first_token_s * 1e3:.0f} ms, "
              f"{_rate(g.decode_steps, g.decode_s)} decode", file=sys.stderr)
        if check is not None:
            print(f"check    max |logits - eager reference| = {check.max_abs_diff:.3g}, "
                  f"argmax disagreements: {check.argmax_mismatches}", file=sys.stderr)
        print(memory_table(metrics), file=sys.stderr)

    if a.json:
        out = {
            "pte": str(a.pte),
            "prompt": a.prompt,
            "chat": a.chat,
            "prompt_ids": g.prompt_ids,
            "generated_ids": g.generated_ids,
            "text": text,
            "stop_reason": g.stop_reason,
            "message": g.message,
            "timings": {
                "export_s": sum((sidecar.get("timings_s") or {}).values()),
                "load_s": load_s,
                "first_token_s": g.first_token_s,
                "prefill_s": g.prefill_s, "prefill_tokens": len(prompt_ids),
                "prefill_tokens_per_s": len(prompt_ids) / g.prefill_s if g.prefill_s > 0 else None,
                "decode_s": g.decode_s, "decode_steps": g.decode_steps,
                "decode_tokens_per_s": g.decode_steps / g.decode_s if g.decode_s > 0 and g.decode_steps else None,
            },
            "sampling": {"temperature": a.temperature, "top_p": a.top_p, "seed": a.seed},
            "max_write": max_write,
            "metrics": metrics,
        }
        if check is not None:
            out["check"] = {"max_abs_diff": check.max_abs_diff, "argmax_mismatches": check.argmax_mismatches}
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    # Running out of capacity before the prompt is even in is a failure; after it, an ending.
    return 1 if g.stop_reason == "capacity" and not g.generated_ids else 0


if __name__ == "__main__":
    sys.exit(main())
