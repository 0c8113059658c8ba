"""Load Llama checkpoints (Meta and Hugging Face formats) onto ``model.Transformer``.

Both loaders are strict: every checkpoint tensor must map onto a model tensor of
the same shape and every model tensor must be provided, otherwise a ``ValueError``
names the first offending tensor. A silently half-loaded model produces plausible
garbage, which is much harder to debug than a refusal.

Meta checkpoints (``consolidated.*.pth`` + ``params.json``) store q/k projections
in the interleaved RoPE layout; ``model.py`` rotates with the half-split (Hugging
Face) convention, so wq/wk are permuted at load exactly as Hugging Face's
``convert_llama_weights_to_hf`` does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from json_files import REQUIRED, json_field, read_json_object
from model import MLP_ACTIVATIONS, ModelArgs, Transformer
from offgraph_kv.schemas.manifest import dtype_from_name, dtype_short_name

# Mistral's, Qwen2's, Qwen3's and Phi-3's blocks are Llama's (Qwen2: plus q/k/v biases; Qwen3:
# plus per-head q/k RMSNorms; Phi-3: q/k/v and gate/up each stored as one fused projection); their
# sliding windows make layers rings. Gemma's are too, with (1 + weight) norms, scaled embeddings and a
# GELU gate; Gemma 2 adds a norm after each sublayer and its own softmax scale (and RoPE bases per
# layer kind in Gemma 3, with Qwen3's q/k norms).
SUPPORTED_HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                              "Phi3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                              "GraniteForCausalLM", "SmolLM3ForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM")
_HF_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                   "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM",
                   "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "granite": "GraniteForCausalLM",
                   "smollm3": "SmolLM3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM"}
_OLMO = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")
# The RoPE base transformers takes when a config states none (its configs' default_theta; 10,000 elsewhere).
_HF_DEFAULT_ROPE_THETA = {"Gemma3ForCausalLM": 1e6, "SmolLM3ForCausalLM": 2e6, "Olmo3ForCausalLM": 5e5}
# Architectures with RoPE parameters per layer kind (full / sliding): (the 4.x field of the sliding
# layers' base, or None where the full layers' default is theirs too, that default).
_HF_ROPE_PER_KIND = {"Gemma3ForCausalLM": ("rope_local_base_freq", 10000.0),
                     "Olmo3ForCausalLM": (None, _HF_DEFAULT_ROPE_THETA["Olmo3ForCausalLM"])}
# Sliding layers by default (a 4,096 window) where a config lists no layer_types: every n-th layer is
# full (Gemma 3 reads n from sliding_window_pattern, default 6).
_HF_SLIDING_PATTERNS = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6, "Olmo3ForCausalLM": 4}
# Architectures whose attention reads no sliding_window at all.
_HF_NO_WINDOWS = ("GraniteForCausalLM", "Olmo2ForCausalLM")
# The architectures whose MLP reads config.json's mlp_bias (Mistral's and Qwen's have none whatever it says).
_HF_MLP_BIAS = ("LlamaForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM")
_GEMMA = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Gemma 2/3: a norm before and after each sublayer.
_SANDWICH = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# transformers' ACT2FN names of the MLP gates model.py computes ("gelu_new" is the tanh formula too).
_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                   "gelu_new": "gelu_tanh"}
# RoPE types hf_args reads (transformers' names); any other is refused.
_HF_ROPE_TYPES = ("default", "llama3", "linear")

# Tensors some checkpoints carry that are derived, not learned: model.py
# recomputes them from the config, so they are dropped rather than "unused".
_DERIVED = re.compile(r"(^rope\.freqs$)|(\.rotary_emb\.inv_freq$)")

# What a checkpoint's weights may be stored as: integer or float8 codes are a
# quantized checkpoint's, meaningless without its scales (never cast silently).
_FLOAT_WEIGHTS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _number(config: Mapping[str, object], key: str, where: str, kind: type = int,
            default: object = REQUIRED) -> "int | float":
    """``config[key]`` as an integer (``kind`` int) or a number (float): ``json_field``'s rules."""
    return json_field(config, key, "int" if kind is int else "number", where, default)


def _read_tensors(path: Path) -> Dict[str, torch.Tensor]:
    """The tensors of one safetensors or torch-pickle weights file; a ValueError naming it when damaged."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file  # optional dependency: only these loaders need it

            return load_file(str(path))
        # weights_only: a checkpoint is data, never code to run.
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # safetensors' and torch's readers raise their own types for damage
        raise ValueError(f"{path.name} is not a readable weights file: {str(e).splitlines()[0] if str(e) else e!r}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path.name} does not hold a flat dict of tensors")
    return state


@dataclass
class LoadedCheckpoint:
    """A model with its weights, plus where they came from (for the export sidecar)."""

    model: Transformer
    source: Dict[str, object]
    dtype: torch.dtype
    # Token ids that end generation according to the checkpoint's own config.
    stop_token_ids: List[int] = field(default_factory=list)
    bos_token_id: Optional[int] = None

    @property
    def args(self) -> ModelArgs:
        """The model's shape (the model's own ``args``: one object, so a change shows in both)."""
        return self.model.args


def parse_dtype(name: "str | torch.dtype | None") -> Optional[torch.dtype]:
    """The weights' dtype from its name (None: keep the checkpoint's)."""
    return None if name is None else dtype_from_name(name, what="dtype")


def default_weights_dtype(device: str) -> str:
    """bf16 where the device computes it natively (CUDA; a CPU with AVX512-BF16 or AMX, as oneDNN
    reports), fp32 elsewhere. Measured on SmolLM2 (2026-12-01, AVX512-BF16 CPU, one thread): bf16
    weights decode in 0.59x the time of fp32 and prefill 3.2x faster, at half the memory, and the
    compiled bf16 program is closer to the fp32 model than eager bf16 is (max |logit error| 0.52
    vs 0.99 over a 48-token prompt)."""
    if device == "cuda":
        return "bf16"
    return "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"


def dtype_name(dtype: torch.dtype) -> str:
    return dtype_short_name(dtype)


# --------------------------------------------------------------------------- #
# RoPE layout permutation (Meta interleaved <-> Hugging Face half-split)
# --------------------------------------------------------------------------- #


def permute_interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a Meta q/k projection for half-split RoPE.

    Meta rotates pairs (2i, 2i+1) of each head; the half-split rotation pairs
    (i, i + head_dim/2). Same as ``permute`` in HF's convert_llama_weights_to_hf.
    """
    rows = w.shape[0]  # a weight's rows, or a bias's entries
    return w.reshape(n_heads, rows // n_heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def permute_half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`permute_interleaved_to_half` (writes Meta-layout q/k)."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


# --------------------------------------------------------------------------- #
# Strict mapping onto the model
# --------------------------------------------------------------------------- #


# 2**40 elements (2 TB in bf16) per weight: the largest real ones (262k-token embeddings of width
# 16k) hold ~2**32.
MAX_WEIGHT_ELEMENTS = 1 << 40
# 16M tokens: wider than any model's context (a ring layer allocates its window's rows).
MAX_WINDOW = 1 << 24


def check_args(args: ModelArgs, where: str, layers_held: Optional[int] = None) -> None:
    """Refuse settings no model computes with (zero sizes, a non-positive RoPE base, a negative or
    non-finite norm epsilon, degenerate RoPE scaling), naming them, before anything is built; and a
    layer count above the ``layers_held`` blocks the checkpoint's tensors carry, before millions
    of blocks are built from a damaged count."""
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"{where}: {name} must be >= 1, got {getattr(args, name)}")
    if args.hidden_dim is not None and args.hidden_dim < 1:
        raise ValueError(f"{where}: the feed-forward size must be >= 1, got {args.hidden_dim}")
    if args.attention_head_dim is not None and args.attention_head_dim < 1:
        raise ValueError(f"{where}: the head dim must be >= 1, got {args.attention_head_dim}")
    # Sizes past any real checkpoint (a damaged count): named here, not as an overflow inside torch.
    for what, rows, cols in (("the embedding", args.vocab_size, args.dim),
                             ("a feed-forward weight", args.ffn_hidden, args.dim),
                             ("the query projection", args.n_heads * args.head_dim, args.dim)):
        if rows * cols > MAX_WEIGHT_ELEMENTS:
            raise ValueError(f"{where}: {what} would be {rows} x {cols}, more than the {MAX_WEIGHT_ELEMENTS} "
                             "elements any checkpoint's weight holds")
    if args.n_heads % args.n_kv_heads:
        raise ValueError(f"{where}: {args.n_heads} query heads is not a multiple of {args.n_kv_heads} KV heads")
    if not (math.isfinite(args.rope_theta) and args.rope_theta > 0):
        raise ValueError(f"{where}: the RoPE base (rope_theta) must be a finite number > 0, got {args.rope_theta}")
    for name in ("attention_scale", "local_rope_theta", "final_logit_softcap", "logits_scaling"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{where}: {name} must be a finite number > 0 (or absent), got {value}")
    for name in ("embedding_multiplier", "residual_multiplier"):
        value = getattr(args, name)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{where}: {name} must be a finite number (or absent), got {value}")
    if args.qk_norm_full and not args.qk_norm:
        raise ValueError(f"{where}: qk_norm_full says how the q/k norms normalise, but qk_norm is off")
    bad = sorted({i for i in args.nope_layers if not 0 <= i < args.n_layers})
    if bad or len(set(args.nope_layers)) != len(args.nope_layers):
        raise ValueError(f"{where}: nope_layers must list distinct layer indices in [0, {args.n_layers}), "
                         f"got {args.nope_layers}")
    if args.mlp_act not in MLP_ACTIVATIONS:
        raise ValueError(f"{where}: mlp_act {args.mlp_act!r} is not one of {', '.join(MLP_ACTIVATIONS)}")
    if not (math.isfinite(args.norm_eps) and args.norm_eps >= 0):
        raise ValueError(f"{where}: the RMSNorm epsilon must be a finite number >= 0, got {args.norm_eps}")
    s = args.rope_scaling or {}
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        value = s.get(key)
        if value is not None and not (math.isfinite(float(value)) and float(value) > 0):
            raise ValueError(f"{where}: RoPE scaling {key} must be a finite number > 0, got {value}")
    if s and s.get("rope_type", "llama3") == "llama3" and s.get("low_freq_factor") == s.get("high_freq_factor") \
            and s.get("low_freq_factor") is not None:
        raise ValueError(f"{where}: llama3 RoPE scaling needs low_freq_factor != high_freq_factor, "
                         f"both are {s['low_freq_factor']}")
    # More blocks than stated are named tensor by tensor later; fewer must be caught before building.
    if layers_held is not None and args.n_layers > layers_held:
        raise ValueError(f"{where} states {args.n_layers} layers, its tensors hold only {layers_held}")


def layers_held_by(names: Iterable[str], prefix: str) -> int:
    """How many blocks ``prefix<N>.`` tensor names number (the highest index + 1)."""
    found = [int(m.group(1)) for m in (re.match(re.escape(prefix) + r"(\d+)\.", n) for n in names) if m]
    return max(found) + 1 if found else 0


def _expected_shapes(args: ModelArgs) -> Dict[str, torch.Size]:
    with torch.device("meta"):
        model = Transformer(args)
    # state_dict lists a tied weight under both names; both are expected.
    return {k: v.shape for k, v in model.state_dict().items()}


def _common_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    """The dtype most of the checkpoint's floating-point bytes are stored in."""
    totals: Dict[torch.dtype, int] = {}
    for t in tensors:
        if t.is_floating_point():
            totals[t.dtype] = totals.get(t.dtype, 0) + t.numel()
    if not totals:
        raise ValueError("the checkpoint holds no floating-point tensors")
    return max(totals, key=totals.__getitem__)


def _check_finite(tensor: torch.Tensor, what: str, before_cast: Optional[torch.Tensor] = None) -> None:
    """A ValueError naming ``what`` when ``tensor`` holds NaN or infinite values (and, for a cast,
    the largest magnitude that overflowed)."""
    bad = ~torch.isfinite(tensor)
    if not bad.any():
        return
    count, first = int(bad.sum()), tuple(int(i) for i in bad.nonzero()[0])
    if before_cast is not None:
        largest = float(before_cast.abs().max())
        raise ValueError(f"{what} overflows: {count} values become infinite (the largest magnitude is {largest:g}; "
                         f"{tensor.dtype} holds up to {torch.finfo(tensor.dtype).max:g}); keep the checkpoint's "
                         "dtype or pass another --dtype")
    raise ValueError(f"{what} holds {count} NaN or infinite values (the first at index {first}): "
                     "a damaged checkpoint")


def build_model(
    args: ModelArgs,
    state: Mapping[str, torch.Tensor],
    dtype: Optional[torch.dtype] = None,
    source_names: Optional[Mapping[str, str]] = None,
) -> Tuple[Transformer, torch.dtype]:
    """Build ``Transformer(args)`` holding exactly ``state`` (names in model.py's scheme);
    the caller has checked ``args`` (``check_args``) before building anything from them.

    ``source_names`` maps a model name back to the checkpoint's own name, so that
    errors speak the checkpoint's language. Weights stay in the checkpoint dtype
    unless ``dtype`` is given.
    """
    names = dict(source_names or {})

    def label(key: str) -> str:
        src = names.get(key)
        return f"{src!r} (model tensor {key!r})" if src and src != key else repr(key)

    expected = _expected_shapes(args)
    for key, tensor in state.items():
        if key not in expected:
            raise ValueError(f"checkpoint tensor {label(key)} is not used by the model")
        if tensor.dtype not in _FLOAT_WEIGHTS:
            raise ValueError(
                f"checkpoint tensor {label(key)} is stored as {tensor.dtype}: quantized checkpoints are not "
                "read (load the float checkpoint; export.py --quantize quantizes it)"
            )
        if tuple(tensor.shape) != tuple(expected[key]):
            raise ValueError(
                f"checkpoint tensor {label(key)} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(expected[key])}"
            )
    for key in expected:
        if key not in state:
            raise ValueError(f"checkpoint is missing tensor {label(key)}")

    target = dtype or _common_dtype(state.values())
    cast = {}
    for key, tensor in state.items():
        # Refused, not warned: a NaN or infinite weight turns every logit it reaches into NaN (or a
        # constant argmax), so the model would generate garbage that looks like a working export.
        _check_finite(tensor, f"checkpoint tensor {label(key)}")
        cast[key] = tensor.to(target)
        if target.itemsize < tensor.dtype.itemsize or target == torch.float16:  # a narrower range: may overflow
            _check_finite(cast[key], f"checkpoint tensor {label(key)} cast to {target}", tensor)
    with torch.device("meta"):
        model = Transformer(args)
    model.load_state_dict(cast, strict=True, assign=True)
    if args.tie_embeddings:
        # assign=True replaced the two entries separately; restore the tie.
        model.output.weight = model.tok_embeddings.weight
    # Non-persistent buffers, still on the meta device: recompute them for real.
    model.reset_rope()
    return model.eval(), target


# --------------------------------------------------------------------------- #
# Meta format
# --------------------------------------------------------------------------- #

# params.json keys that change the architecture in ways model.py does not have.
_META_UNSUPPORTED = ("moe", "num_experts", "use_qk_norm", "attention_qkv_bias", "use_hf_rope")

# Concatenation dim of each tensor across model-parallel shards (None: replicated).
_META_SHARD_DIM = [
    (re.compile(r"^tok_embeddings\.weight$"), 1),
    (re.compile(r"\.attention\.w[qkv]\.weight$"), 0),
    (re.compile(r"\.attention\.wo\.weight$"), 1),
    (re.compile(r"\.feed_forward\.w[13]\.weight$"), 0),
    (re.compile(r"\.feed_forward\.w2\.weight$"), 1),
    (re.compile(r"^output\.weight$"), 0),
]


def _meta_shard_dim(name: str) -> Optional[int]:
    for pattern, dim in _META_SHARD_DIM:
        if pattern.search(name):
            return dim
    return None


def meta_args(params: Mapping[str, object], vocab_size: Optional[int] = None) -> ModelArgs:
    """ModelArgs from a Meta ``params.json`` (``vocab_size: -1`` is taken from the weights)."""
    for key in _META_UNSUPPORTED:
        if params.get(key):
            raise ValueError(f"params.json sets {key!r}, which this Llama model does not implement")
    where = "params.json"
    vocab = json_field(params, "vocab_size", "int", where, -1)
    if vocab <= 0:
        if vocab_size is None:
            raise ValueError("params.json has no vocab_size and no tok_embeddings.weight to infer it from")
        vocab = vocab_size
    rope_scaling = None
    if json_field(params, "use_scaled_rope", "bool", where, False):
        # Meta's Llama 3.1+ scaling; factor 8 unless the params say otherwise
        # (ExecuTorch's params for Llama 3.2 1B/3B set rope_scale_factor 32).
        rope_scaling = {
            "rope_type": "llama3",
            "factor": json_field(params, "rope_scale_factor", "number", where, 8.0),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    n_heads = _number(params, "n_heads", where)
    multiple_of = json_field(params, "multiple_of", "int", where, 256)
    if multiple_of < 1:  # the feed-forward width is rounded up to it (a zero divides by zero)
        raise ValueError(f"{where}: 'multiple_of' must be >= 1, got {multiple_of}")
    return ModelArgs(
        dim=_number(params, "dim", where),
        n_layers=_number(params, "n_layers", where),
        n_heads=n_heads,
        n_kv_heads=json_field(params, "n_kv_heads", "int", where, n_heads),
        vocab_size=vocab,
        hidden_dim=json_field(params, "hidden_dim", "int", where, None),
        multiple_of=multiple_of,
        ffn_dim_multiplier=json_field(params, "ffn_dim_multiplier", "number", where, None),
        norm_eps=json_field(params, "norm_eps", "number", where, 1e-5),
        rope_theta=json_field(params, "rope_theta", "number", where, 10000.0),
        rope_scaling=rope_scaling,
        tie_embeddings=False,
    )


def _meta_shards(checkpoint: Path) -> List[Path]:
    if checkpoint.is_dir():
        shards = sorted(checkpoint.glob("consolidated*.pth"))
        if not shards:
            raise FileNotFoundError(f"no consolidated*.pth in {checkpoint}")
        return shards
    if not checkpoint.is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint} does not exist")
    return [checkpoint]


def _merge_meta_shards(shards: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    if len(shards) == 1:
        return shards[0]
    names = list(shards[0])
    for i, shard in enumerate(shards[1:], start=1):
        if set(shard) != set(names):
            odd = sorted(set(shard) ^ set(names))[0]
            raise ValueError(f"model-parallel shard {i} disagrees with shard 0 on tensor {odd!r}")
    merged = {}
    for name in names:
        dim = _meta_shard_dim(name)
        first = shards[0][name]
        for i, shard in enumerate(shards[1:], start=1):
            t = shard[name]
            # torch.cat promotes mixed dtypes and raises its own error on mismatched sizes; a replicated
            # tensor (a norm) that differs would be taken from shard 0 alone: all are a damaged shard.
            if t.dtype != first.dtype:
                raise ValueError(f"model-parallel shard {i} stores tensor {name!r} as {t.dtype}, "
                                 f"shard 0 as {first.dtype}")
            kept = [d for d in range(first.dim()) if d != dim]
            if t.dim() != first.dim() or [t.shape[d] for d in kept] != [first.shape[d] for d in kept]:
                raise ValueError(f"model-parallel shard {i} holds tensor {name!r} of shape {tuple(t.shape)}, "
                                 f"which does not {'concatenate with' if dim is not None else 'equal'} shard 0's "
                                 f"{tuple(first.shape)}" + (f" along dim {dim}" if dim is not None else ""))
            if dim is None and not torch.equal(t, first):
                raise ValueError(f"model-parallel shard {i} holds replicated tensor {name!r} with other values "
                                 "than shard 0")
        merged[name] = first if dim is None else torch.cat([s[name] for s in shards], dim=dim)
    return merged


def load_meta(
    checkpoint: "str | Path",
    params: "str | Path | None" = None,
    dtype: "str | torch.dtype | None" = None,
) -> LoadedCheckpoint:
    """Load ``consolidated*.pth`` (a file, or a directory of model-parallel shards) + ``params.json``."""
    checkpoint = Path(checkpoint)
    shards = _meta_shards(checkpoint)
    params_path = Path(params) if params else shards[0].parent / "params.json"
    if not params_path.is_file():
        raise FileNotFoundError(f"params file {params_path} does not exist (pass --params)")
    raw = read_json_object(params_path)
    state = _merge_meta_shards([_read_tensors(p) for p in shards])
    state = {k: v for k, v in state.items() if not _DERIVED.search(k)}
    emb = state.get("tok_embeddings.weight")
    args = meta_args(raw, vocab_size=emb.shape[0] if emb is not None else None)
    check_args(args, str(params_path), layers_held_by(state, "layers."))

    # Shapes are checked before the permutation (which needs them right).
    expected = _expected_shapes(args)
    for key, tensor in state.items():
        if key in expected and tuple(tensor.shape) != tuple(expected[key]):
            raise ValueError(
                f"checkpoint tensor {key!r} has shape {tuple(tensor.shape)}, the model expects {tuple(expected[key])}"
            )
    for key in list(state):
        if key.endswith(".attention.wq.weight"):
            state[key] = permute_interleaved_to_half(state[key], args.n_heads)
        elif key.endswith(".attention.wk.weight"):
            state[key] = permute_interleaved_to_half(state[key], args.n_kv_heads)
    model, target = build_model(args, state, parse_dtype(dtype))
    return LoadedCheckpoint(
        model=model,
        source={"format": "meta", "checkpoint": str(checkpoint.resolve()), "params": str(params_path.resolve())},
        dtype=target,
    )


def to_meta_state_dict(model: Transformer) -> Dict[str, torch.Tensor]:
    """``model``'s weights in Meta's layout and names (what ``load_meta`` reads back)."""
    args = model.args
    out = {}
    for key, tensor in model.state_dict().items():
        t = tensor.detach().clone()
        if key.endswith(".attention.wq.weight"):
            t = permute_half_to_interleaved(t, args.n_heads)
        elif key.endswith(".attention.wk.weight"):
            t = permute_half_to_interleaved(t, args.n_kv_heads)
        out[key] = t
    return out


# --------------------------------------------------------------------------- #
# Hugging Face format
# --------------------------------------------------------------------------- #

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.o_proj.bias": "attention.wo.bias",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.gate_proj.bias": "feed_forward.w1.bias",
    "mlp.down_proj.bias": "feed_forward.w2.bias",
    "mlp.up_proj.bias": "feed_forward.w3.bias",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_HF_TOP_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


def map_tensor_name(name: str, top: Mapping[str, str], per_layer: "re.Pattern[str]",
                    layer_names: Mapping[str, str]) -> Optional[str]:
    """model.py's name for a checkpoint tensor: a top-level name from ``top``, or
    ``per_layer`` matching (layer index, suffix) with the suffix in ``layer_names``."""
    if name in top:
        return top[name]
    m = per_layer.match(name)
    if m and m.group(2) in layer_names:
        return f"layers.{m.group(1)}.{layer_names[m.group(2)]}"
    return None


# Phi-3's fused projections: each is model.py's tensors stacked along the rows in this order (transformers
# splits the q/k/v output as q, k, v and chunks gate/up in halves, gate first). Phi-3 stores no others of
# these tensors, so their unfused names are not its own.
_HF_FUSED_LAYER_NAMES = {
    "self_attn.qkv_proj.weight": ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight"),
    "mlp.gate_up_proj.weight": ("feed_forward.w1.weight", "feed_forward.w3.weight"),
}
# Phi-3's names of the tensors it stores unfused.
_HF_PHI3_LAYER_NAMES = {k: v for k, v in _HF_LAYER_NAMES.items()
                        if v not in {p for parts in _HF_FUSED_LAYER_NAMES.values() for p in parts}}
# Gemma 2/3 normalise each sublayer's output too; their post_attention_layernorm is that second norm of
# the attention (Llama's is the MLP's input norm, pre_feedforward_layernorm here).
_HF_SANDWICH_LAYER_NAMES = {**_HF_LAYER_NAMES,
                            "post_attention_layernorm.weight": "post_attention_norm.weight",
                            "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                            "post_feedforward_layernorm.weight": "post_ffn_norm.weight"}
# OLMo 2 normalises only each sublayer's output: its post_attention_layernorm is that norm too, and it has
# no input norms.
_HF_POST_LAYER_NAMES = {**{k: v for k, v in _HF_LAYER_NAMES.items() if "layernorm" not in k},
                        "post_attention_layernorm.weight": "post_attention_norm.weight",
                        "post_feedforward_layernorm.weight": "post_ffn_norm.weight"}
# How an architecture names its per-layer tensors: (one-to-one names, fused tensors' parts).
_HF_LAYOUTS: Dict[str, Tuple[Mapping[str, str], Mapping[str, Tuple[str, ...]]]] = {
    "plain": (_HF_LAYER_NAMES, {}),
    "fused": (_HF_PHI3_LAYER_NAMES, _HF_FUSED_LAYER_NAMES),
    "sandwich": (_HF_SANDWICH_LAYER_NAMES, {}),
    "post": (_HF_POST_LAYER_NAMES, {}),
}


def hf_architectures(config: Mapping[str, object]) -> List[str]:
    """The one architecture ``config.json`` names (its ``architectures``, else its ``model_type``'s), as a
    list; a ValueError naming an unsupported one, none, or several."""
    where = "config.json"
    archs = list(json_field(config, "architectures", "strs", where, []))
    if not archs:
        model_type = json_field(config, "model_type", "str", where, None)
        if model_type not in _HF_MODEL_TYPES:
            raise ValueError(
                f"config.json names no architecture and model_type {model_type!r}; "
                f"supported: {', '.join(SUPPORTED_HF_ARCHITECTURES)}"
            )
        archs = [_HF_MODEL_TYPES[model_type]]
    for arch in archs:
        if arch not in SUPPORTED_HF_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} in config.json; supported: {', '.join(SUPPORTED_HF_ARCHITECTURES)}"
            )
    if len(set(archs)) > 1:
        raise ValueError(f"config.json names several architectures {archs}: one checkpoint is one model")
    return archs


def hf_tensor_layout(config: Mapping[str, object]) -> str:
    """How the checkpoint's architecture names its layer tensors: "fused" (Phi-3's fused projections),
    "sandwich" (Gemma 2/3's four norms per block), "post" (OLMo 2's output norms only) or "plain" (Llama's)."""
    arch = hf_architectures(config)[0]
    if arch == "Phi3ForCausalLM":
        return "fused"
    if arch in _OLMO:
        return "post"
    return "sandwich" if arch in _SANDWICH else "plain"


def hf_to_model_names(name: str, layout: str = "plain") -> Optional[List[str]]:
    """model.py's names for a Hugging Face tensor: its one tensor, or a fused projection's parts in their
    row order (``layout`` "fused", Phi-3); None if it has none."""
    names, fused = _HF_LAYOUTS[layout]
    m = _HF_LAYER.match(name)
    if m and m.group(2) in fused:
        return [f"layers.{m.group(1)}.{part}" for part in fused[m.group(2)]]
    key = map_tensor_name(name, _HF_TOP_NAMES, _HF_LAYER, names)
    return None if key is None else [key]


def _stacked_shape(parts: List[str], expected: Mapping[str, torch.Size]) -> Tuple[int, ...]:
    """The shape of the checkpoint tensor holding ``parts``: their rows stacked (one part: its own shape)."""
    return (sum(int(expected[p][0]) for p in parts),) + tuple(expected[parts[0]])[1:]


def hf_args(config: Mapping[str, object], layers_held: Optional[int] = None) -> ModelArgs:
    """ModelArgs from a Hugging Face ``config.json`` (transformers 4.x or 5.x spelling); a layer count
    above the ``layers_held`` blocks the weights carry is named before any per-layer list is made."""
    where = "config.json"
    archs = hf_architectures(config)
    qwen2 = "Qwen2ForCausalLM" in archs
    qwen3 = "Qwen3ForCausalLM" in archs
    arch = archs[0]
    gemma = arch in _GEMMA
    sandwich = arch in _SANDWICH
    olmo = arch in _OLMO
    if config.get("quantization_config"):
        method = dict(config["quantization_config"]).get("quant_method", "?") \
            if isinstance(config["quantization_config"], dict) else "?"
        raise ValueError(f"config.json has a quantization_config ({method}): quantized checkpoints are not read "
                         "(load the float checkpoint; export.py --quantize quantizes it)")
    # Honouring mlp_bias where transformers' MLP has no biases would load a different model than it does.
    mlp_bias = json_field(config, "mlp_bias", "bool", where, False)
    if mlp_bias and arch not in _HF_MLP_BIAS:
        raise ValueError(f"config.json sets mlp_bias=true, which {', '.join(archs)} does not read "
                         f"(only {', '.join(_HF_MLP_BIAS)}'s MLPs have biases)")
    n_layers = _number(config, "num_hidden_layers", where)
    if layers_held is not None and n_layers > layers_held:  # a damaged count listed a window per layer (GBs)
        raise ValueError(f"{where} states {n_layers} layers, its tensors hold only {layers_held}")
    if json_field(config, "use_bidirectional_attention", "bool", where, False):
        raise ValueError("config.json sets use_bidirectional_attention: a bidirectional encoder, not a decoder")
    nope: List[int] = []
    if arch == "SmolLM3ForCausalLM":
        nope, windows = _smollm3_layers(config, n_layers)
    elif arch in _HF_NO_WINDOWS:
        windows = [0]
    else:  # Qwen3 decides its sliding layers as Qwen2 does
        windows = _hf_windows(config, n_layers, qwen2 or qwen3, arch)
    # Gemma 2/3's MLPs read hidden_activation, Gemma's (as every other here) hidden_act.
    act_key = "hidden_activation" if sandwich else "hidden_act"
    act = json_field(config, act_key, "str", where, "gelu_pytorch_tanh" if gemma else "silu")
    if act not in _HF_ACTIVATIONS:
        raise ValueError(f"config.json {act_key} {act!r} is not supported (only {', '.join(_HF_ACTIVATIONS)})")
    if arch == "GemmaForCausalLM" and act == "gelu":
        # gemma-2b/7b's released configs say "gelu" but were trained with the tanh formula; transformers
        # computes tanh from it (its GemmaConfig rewrites the value), so the same weights give the same logits.
        act = "gelu_pytorch_tanh"
    dim = _number(config, "hidden_size", where)
    n_heads = _number(config, "num_attention_heads", where)
    if n_heads <= 0 or dim <= 0:
        raise ValueError(f"config.json: hidden_size {dim} and num_attention_heads {n_heads} must be positive")
    # An explicit head_dim may differ from hidden_size / heads (e.g. Llama-3.1-Minitron-4B-Width: 3072 / 32, 128).
    head_dim = config.get("head_dim")
    if head_dim is None and (qwen3 or gemma):
        # Qwen3Config's and the Gemma configs' defaults, which transformers uses when the file gives none.
        head_dim = 256 if gemma else 128
    else:
        head_dim = _number(config, "head_dim", where) if head_dim is not None else None
    if head_dim is None and dim % n_heads:
        raise ValueError(f"config.json: hidden_size {dim} is not a multiple of num_attention_heads {n_heads} "
                         "and no head_dim is given")
    # transformers 5 folds rope_theta / rope_scaling into rope_parameters.
    rope_key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    rope = dict(json_field(config, rope_key, "object", where, {}))
    rope_where = f"config.json {rope_key}"
    local_theta = None
    if arch in _HF_ROPE_PER_KIND:
        rope, rope_where, local_theta = _rope_per_layer_kind(config, rope, rope_key, arch)
    theta = json_field(rope, "rope_theta", "number", rope_where,
                       json_field(config, "rope_theta", "number", where, _HF_DEFAULT_ROPE_THETA.get(arch, 10000.0)))
    rope_type = json_field(rope, "rope_type", "str", rope_where, json_field(rope, "type", "str", rope_where, "default"))
    # A partial rotation (RoPE on some head dims only) is not what model.py rotates.
    for key, value in (("partial_rotary_factor", json_field(config, "partial_rotary_factor", "number", where, None)),
                       (f"{rope_key}.partial_rotary_factor",
                        json_field(rope, "partial_rotary_factor", "number", rope_where, None))):
        if value is not None and value != 1:
            raise ValueError(f"config.json {key} = {value!r} is not supported (only 1: RoPE on every head dim)")
    if rope_type == "llama3":
        rope_where = "config.json rope scaling (llama3)"
        scaling = {
            "rope_type": "llama3",
            "factor": _number(rope, "factor", rope_where, float),
            "low_freq_factor": _number(rope, "low_freq_factor", rope_where, float),
            "high_freq_factor": _number(rope, "high_freq_factor", rope_where, float),
            "original_max_position_embeddings": _number(rope, "original_max_position_embeddings", rope_where),
        }
    elif rope_type == "linear":
        factor = _number(rope, "factor", "config.json rope scaling (linear)", float)
        if factor <= 0:
            raise ValueError(f"config.json rope scaling (linear): 'factor' must be positive, got {factor}")
        scaling = {"rope_type": "linear", "factor": factor}
    elif rope_type == "default":
        scaling = None
    else:
        raise ValueError(f"config.json rope_type {rope_type!r} is not supported "
                         f"(only {', '.join(repr(t) for t in _HF_ROPE_TYPES)})")
    attention_bias = json_field(config, "attention_bias", "bool", where, False)
    scale, final_cap = _gemma_scales(config, arch) if sandwich else (None, None)
    multipliers: Dict[str, Optional[float]] = {}
    if arch == "GraniteForCausalLM":
        scale, multipliers = _granite_multipliers(config)
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=_number(config, "num_key_value_heads", where, default=n_heads),
        vocab_size=_number(config, "vocab_size", where),
        hidden_dim=_number(config, "intermediate_size", where),
        norm_eps=_number(config, "rms_norm_eps", where, float, default=1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=json_field(config, "tie_word_embeddings", "bool", where,
                                  gemma or arch == "SmolLM3ForCausalLM"),
        attention_head_dim=head_dim if head_dim is not None and head_dim * n_heads != dim else None,
        sliding_windows=windows,
        qkv_bias=qwen2 or attention_bias,
        out_bias=attention_bias,
        mlp_bias=mlp_bias,
        qk_norm=qwen3 or olmo or arch == "Gemma3ForCausalLM",
        qk_norm_full=olmo,
        pre_norms=not olmo,
        norm_fp32_weight=olmo,
        norm_offset=gemma,
        embed_scale=gemma,
        mlp_act=_HF_ACTIVATIONS[act],
        sandwich_norms=sandwich or olmo,
        attention_scale=scale,
        local_rope_theta=local_theta,
        final_logit_softcap=final_cap,
        nope_layers=nope,
        **multipliers,
    )


def _rope_per_layer_kind(config: Mapping[str, object], rope: Dict[str, object], rope_key: str,
                         arch: str) -> Tuple[Dict[str, object], str, float]:
    """Gemma 3's and OLMo 3's RoPE: the full layers' parameters (with any scaling), where, and the sliding
    layers' base; transformers 5 nests both under rope_parameters by layer kind, 4.x gave rope_theta and
    rope_scaling for the full layers and (Gemma 3) rope_local_base_freq, or (OLMo 3) nothing: its sliding
    layers then take the default base."""
    where = "config.json"
    local_key, local = _HF_ROPE_PER_KIND[arch]
    if "full_attention" in rope or "sliding_attention" in rope:
        sliding = dict(json_field(rope, "sliding_attention", "object", f"{where} {rope_key}", {}))
        local_where = f"{where} {rope_key}.sliding_attention"
        if json_field(sliding, "rope_type", "str", local_where, "default") != "default":
            raise ValueError(f"{local_where}: only rope_type 'default' is supported on sliding layers")
        local = json_field(sliding, "rope_theta", "number", local_where, local)
        return (dict(json_field(rope, "full_attention", "object", f"{where} {rope_key}", {})),
                f"{where} {rope_key}.full_attention", local)
    if local_key is not None:
        local = json_field(config, local_key, "number", where, local)
    return rope, f"{where} {rope_key}", local


def _gemma_scales(config: Mapping[str, object], arch: str) -> Tuple[float, Optional[float]]:
    """Gemma 2/3's softmax scale (query_pre_attn_scalar ** -0.5) and final logit cap. Gemma 2 caps
    attention logits too, which update_and_attend cannot; Gemma 3's transformers ignores that field."""
    where = "config.json"
    gemma2 = arch == "Gemma2ForCausalLM"
    if gemma2 and _hf_optional(config, "attn_logit_softcapping", "number", 50.0) is not None:
        raise ValueError("config.json: attn_logit_softcapping is set (Gemma 2 caps attention logits with tanh), "
                         "which kvcache::update_and_attend does not compute; only a config with it null loads")
    scalar = json_field(config, "query_pre_attn_scalar", "number", where, 256)
    if not (math.isfinite(scalar) and scalar > 0):
        raise ValueError(f"config.json: query_pre_attn_scalar must be a finite number > 0, got {scalar}")
    return scalar ** -0.5, _hf_optional(config, "final_logit_softcapping", "number", 30.0 if gemma2 else None)


def _granite_multipliers(config: Mapping[str, object]) -> Tuple[float, Dict[str, Optional[float]]]:
    """Granite's softmax scale (attention_multiplier, default 1: not 1/sqrt(head_dim)) and its
    embedding / residual / logits multipliers as ModelArgs fields (a multiplier of 1 computes nothing)."""
    where = "config.json"
    scale = json_field(config, "attention_multiplier", "number", where, 1.0)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"config.json: attention_multiplier must be a finite number > 0, got {scale}")
    # The config's names are ModelArgs' own.
    out: Dict[str, Optional[float]] = {}
    for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        value = json_field(config, key, "number", where, 1.0)
        positive = key == "logits_scaling"  # a divisor
        if not math.isfinite(value) or (positive and value <= 0):
            raise ValueError(f"config.json: {key} must be a finite number{' > 0' if positive else ''}, got {value}")
        out[key] = None if value == 1 else float(value)
    return scale, out


def _smollm3_layers(config: Mapping[str, object], n_layers: int) -> Tuple[List[int], List[int]]:
    """SmolLM3's NoPE layers and windows, as transformers decides them: ``no_rope_layers`` holds 1 for a
    layer that rotates and 0 for one that does not (absent: every ``no_rope_layer_interval``-th layer is
    NoPE); a layer slides only with ``use_sliding_window``, where ``layer_types`` says so (absent: the
    NoPE layers, if a sliding_window is given)."""
    where = "config.json"
    mask = json_field(config, "no_rope_layers", "int_or_ints", where, None)
    if mask is None:
        interval = json_field(config, "no_rope_layer_interval", "int", where, 4)
        if interval < 1:
            raise ValueError(f"config.json: no_rope_layer_interval must be >= 1, got {interval}")
        mask = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if isinstance(mask, int) or len(mask) != n_layers or any(m not in (0, 1) for m in mask):
        shown = mask if isinstance(mask, int) or len(mask) <= 16 else f"a list of {len(mask)}"
        raise ValueError(f"config.json: no_rope_layers must list 0 or 1 for each of the {n_layers} layers, "
                         f"got {shown}")
    nope = [i for i, m in enumerate(mask) if not m]
    if not json_field(config, "use_sliding_window", "bool", where, False):
        return nope, [0]
    if json_field(config, "layer_types", "strs", where, None) is None \
            and _hf_optional(config, "sliding_window", "int", None) is not None:
        config = {**config, "layer_types": ["full_attention" if m else "sliding_attention" for m in mask]}
    return nope, _hf_windows(config, n_layers, False, "SmolLM3ForCausalLM")


def _hf_optional(config: Mapping[str, object], key: str, kind: str, default: object) -> object:
    """A config field transformers lets be None: absent takes the architecture's ``default``, an
    explicit null is None (Gemma 2's softcaps, a window)."""
    if key in config and config[key] is None:
        return None
    return json_field(config, key, kind, "config.json", default)


def _hf_windows(config: Mapping[str, object], n_layers: int, qwen2: bool, arch: str) -> List[int]:
    """Each layer's sliding window (0: full attention), as transformers decides it: ``layer_types``
    where the config lists them; Mistral: every layer; Qwen2: only with ``use_sliding_window``, from
    layer ``max_window_layers`` on; Gemma 2 / 3 / OLMo 3 without a list: every other / every sixth
    (``sliding_window_pattern``) / every fourth layer full. A ring layer here attends keys
    p - window < k <= p, as transformers masks. A window as wide as every context is full attention,
    except in Gemma 3 and OLMo 3, whose sliding layers may rotate with their own RoPE base: they stay
    rings."""
    where = "config.json"
    default = 4096 if arch in _HF_SLIDING_PATTERNS else 0
    window = stated = _hf_optional(config, "sliding_window", "int", default) or 0
    if window < 0:
        raise ValueError(f"config.json: sliding_window must be positive, got {window}")
    longest = json_field(config, "max_position_embeddings", "int", where, 0)
    if longest > 0 and window >= longest and arch not in _HF_ROPE_PER_KIND:
        window = 0
    if window > MAX_WINDOW:  # a ring of that many rows is allocated per layer at run time
        raise ValueError(f"config.json: sliding_window {window} is wider than any model's context "
                         f"(at most {MAX_WINDOW}); a damaged config")
    types = json_field(config, "layer_types", "strs", where, None)
    if types is None and default:
        pattern = _HF_SLIDING_PATTERNS[arch]
        if arch == "Gemma3ForCausalLM":
            pattern = json_field(config, "sliding_window_pattern", "int", where, pattern)
        if pattern < 1:
            raise ValueError(f"config.json: sliding_window_pattern must be >= 1, got {pattern}")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    if types is not None:
        if len(types) != n_layers:
            raise ValueError(f"config.json: layer_types must list {n_layers} layers, it lists {len(types)}")
        unknown = sorted({str(t) for t in types} - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"config.json: layer type(s) {unknown} are not supported")
        if "sliding_attention" in types and not stated:
            raise ValueError("config.json lists sliding_attention layers but no sliding_window")
        windows = [window if t == "sliding_attention" else 0 for t in types]
    elif qwen2:
        first = _number(config, "max_window_layers", where, default=n_layers)
        use = json_field(config, "use_sliding_window", "bool", where, False)
        first = min(max(first, 0), n_layers)
        # One entry when every layer is alike: a list per layer is made only when they differ.
        windows = [0] * first + [window] * (n_layers - first) if use and window and 0 < first < n_layers \
            else [window if use and first < n_layers else 0]
    else:
        windows = [window]
    return windows if len(set(windows)) > 1 else windows[:1]


def model_to_hf_name(key: str, layout: str = "plain") -> str:
    """The Hugging Face name of a model.py tensor (inverse of :func:`hf_to_model_names`); a fused
    projection's part (``layout`` "fused") names the fused tensor that holds it."""
    for hf, ours in _HF_TOP_NAMES.items():
        if ours == key:
            return hf
    _, idx, rest = key.split(".", 2)
    names, fused = _HF_LAYOUTS[layout]
    pairs = list(names.items()) + [(hf, part) for hf, parts in fused.items() for part in parts]
    for hf, ours in pairs:
        if ours == rest:
            return f"model.layers.{idx}.{hf}"
    raise KeyError(key)


def to_hf_state_dict(model: Transformer) -> Dict[str, torch.Tensor]:
    """``model``'s weights under Hugging Face Llama names (what ``load_hf`` reads back).

    A tied output is written once, as the embedding, the way transformers saves it.
    """
    return {
        model_to_hf_name(key): tensor.detach().clone().contiguous()
        for key, tensor in model.state_dict().items()
        if not (key == "output.weight" and model.args.tie_embeddings)
    }


# ModelArgs fields only other families set (a value other than Llama's default): hf_config refuses them.
_OTHER_FAMILY_FIELDS = ("norm_offset", "embed_scale", "mlp_act", "sandwich_norms", "attention_scale",
                        "local_rope_theta", "final_logit_softcap", "embedding_multiplier", "residual_multiplier",
                        "logits_scaling", "nope_layers", "qk_norm_full", "pre_norms", "norm_fp32_weight")


def hf_config(args: ModelArgs) -> Dict[str, object]:
    """A transformers-style ``config.json`` for ``args`` (the inverse of :func:`hf_args`) of the Llama
    family; other families' features are refused by name rather than written as a different model."""
    llama = ModelArgs()
    foreign = [name for name in _OTHER_FAMILY_FIELDS if getattr(args, name) != getattr(llama, name)]
    if foreign:
        raise ValueError(f"hf_config writes Llama-family configs; {', '.join(foreign)} belongs to another family "
                         "(save such a model with transformers)")
    config: Dict[str, object] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": args.tie_embeddings,
        "rope_theta": args.rope_theta,
    }
    if args.rope_scaling:
        # Sidecars written before other types existed hold llama3 scaling without a rope_type.
        config["rope_scaling"] = {"rope_type": "llama3", **args.rope_scaling}
    if args.qk_norm:
        # Qwen3's attention_bias sets the q/k/v and output biases together.
        if args.qkv_bias != args.out_bias:
            raise ValueError("a Hugging Face Qwen3 config has q/k/v biases only with an output-projection bias")
        config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=args.qkv_bias)
    elif args.out_bias:
        if not args.qkv_bias:
            raise ValueError("a Hugging Face config has no output-projection bias without q/k/v biases")
        config["attention_bias"] = True
    elif args.qkv_bias:
        config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    if args.mlp_bias:
        if config["model_type"] != "llama":
            raise ValueError(f"a Hugging Face {config['architectures'][0]} config has no MLP biases "
                             "(only LlamaForCausalLM's mlp_bias)")
        config["mlp_bias"] = True
    windows = [args.window_of(i) for i in range(args.n_layers)]
    if any(windows):
        if len({w for w in windows if w}) != 1:
            raise ValueError(f"a Hugging Face config holds one sliding window, not {args.sliding_windows}")
        # Mistral's config reads no biases or q/k norms: only a plain Llama becomes one.
        if config["model_type"] == "llama" and not args.mlp_bias and not args.out_bias and len(set(windows)) == 1:
            config.update(architectures=["MistralForCausalLM"], model_type="mistral")
        config["sliding_window"] = max(windows)
        if config["model_type"] in ("qwen2", "qwen3"):
            config["use_sliding_window"] = True  # without it transformers' Qwen configs drop the window
        config["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windows]
    return config


def _hf_files(directory: Path) -> List[Path]:
    """The weight files: safetensors (sharded with an index, or not), else pytorch_model*.bin likewise."""
    for index_name, pattern in (("model.safetensors.index.json", "*.safetensors"),
                                ("pytorch_model.bin.index.json", "pytorch_model*.bin")):
        index = directory / index_name
        if index.is_file():
            weight_map = read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index} has no weight_map")
            for name, f in weight_map.items():
                # A shard named outside the directory ("../../x", "/etc/x") would read a file the
                # checkpoint does not own; a non-string would be str()-ed into a made-up name.
                if not isinstance(f, str) or not f or Path(f).is_absolute() \
                        or not (directory / f).resolve().is_relative_to(directory.resolve()):
                    raise ValueError(f"{index}: tensor {name!r} names shard {f!r}, not a file inside {directory}")
            files = sorted({directory / f for f in weight_map.values()})
            for f in files:
                if not f.is_file():
                    raise FileNotFoundError(f"shard {f.name} named by {index.name} is missing")
            return files
        files = sorted(directory.glob(pattern))
        if files:
            return files
    raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {directory}")


def _hf_stop_tokens(directory: Path, config: Mapping[str, object], vocab_size: int) -> Tuple[List[int], Optional[int]]:
    """EOS ids (one or a list) and BOS from generation_config.json, else config.json; an id outside
    the vocabulary is named (as a stop id it would never stop generation)."""
    gen = directory / "generation_config.json"
    source = read_json_object(gen) if gen.is_file() else {}
    found: Dict[str, object] = {}
    for key in ("eos_token_id", "bos_token_id"):
        where = gen.name if source.get(key) is not None else "config.json"
        value = json_field(source if where == gen.name else config, key, "int_or_ints" if key[0] == "e" else "int",
                           where, None)
        for i in value if isinstance(value, list) else [] if value is None else [value]:
            if not 0 <= i < vocab_size:
                raise ValueError(f"{where}: {key!r} holds {i}, outside the vocabulary of {vocab_size} tokens")
        found[key] = value
    eos, bos = found["eos_token_id"], found["bos_token_id"]
    return ([] if eos is None else eos if isinstance(eos, list) else [eos]), bos  # type: ignore[return-value]


def _safetensors_shapes(path: Path) -> Dict[str, Tuple[int, ...]]:
    """Each tensor's shape from a safetensors header, without reading tensor data."""
    try:
        from safetensors import safe_open  # optional dependency: only these loaders need it

        with safe_open(str(path), "pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as e:  # safetensors raises its own types for damage
        raise ValueError(f"{path.name} is not a readable weights file: {str(e).splitlines()[0] if str(e) else e!r}") \
            from e


def _check_hf_headers(config: Mapping[str, object], shapes: Mapping[Path, Mapping[str, Tuple[int, ...]]]) -> None:
    """The name and shape checks build_model makes, from the safetensors headers alone."""
    names = [n for per_file in shapes.values() for n in per_file]
    args = hf_args(config, layers_held_by(names, "model.layers."))
    check_args(args, "config.json", layers_held_by(names, "model.layers."))
    expected = _expected_shapes(args)
    layout = hf_tensor_layout(config)
    for path, per_file in shapes.items():
        for name, shape in per_file.items():
            if _DERIVED.search(name):
                continue
            parts = ["tok_embeddings.weight"] if name == "lm_head.weight" and args.tie_embeddings \
                else hf_to_model_names(name, layout)
            if parts is None or any(p not in expected for p in parts):
                raise ValueError(f"checkpoint tensor {name!r} ({path.name}) is not used by the model")
            want = _stacked_shape(parts, expected)
            if shape != want:
                raise ValueError(f"checkpoint tensor {name!r} (model tensor {', '.join(parts)!r}) has shape {shape}, "
                                 f"the model expects {want}")


def load_hf(directory: "str | Path", dtype: "str | torch.dtype | None" = None) -> LoadedCheckpoint:
    """Load a Hugging Face Llama directory (config.json + *.safetensors or pytorch_model*.bin, sharded or not)."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json")
    config = read_json_object(config_path)
    paths = _hf_files(directory)
    if all(f.suffix == ".safetensors" for f in paths):
        # Names and shapes from the headers first: a damaged or hostile file is refused before its
        # data (possibly gigabytes of a tensor the model never uses) is read into memory.
        _check_hf_headers(config, {f: _safetensors_shapes(f) for f in paths})
    files = {f: _read_tensors(f) for f in paths}
    args = hf_args(config, layers_held_by((n for t in files.values() for n in t), "model.layers."))

    state: Dict[str, torch.Tensor] = {}
    source_names: Dict[str, str] = {}  # model name -> the name read from the files
    if args.tie_embeddings:
        source_names["output.weight"] = "model.embed_tokens.weight"
    lm_head: Optional[torch.Tensor] = None
    layout = hf_tensor_layout(config)
    # A sane layer count before any model is built from it (the expected shapes build one on "meta").
    check_args(args, "config.json", layers_held_by((n for t in files.values() for n in t), "model.layers."))
    expected = _expected_shapes(args)
    for f, tensors in files.items():
        for name, tensor in tensors.items():
            if _DERIVED.search(name):
                continue
            if name == "lm_head.weight" and args.tie_embeddings:
                lm_head = tensor  # checked against the embedding below
                continue
            parts = hf_to_model_names(name, layout)
            if parts is None or (len(parts) > 1 and any(p not in expected for p in parts)):
                raise ValueError(f"checkpoint tensor {name!r} ({f.name}) is not used by the model")
            if len(parts) > 1:  # a fused projection, split here (build_model checks every part's shape)
                want = _stacked_shape(parts, expected)
                if tuple(tensor.shape) != want:  # pytorch_model.bin files had no header check
                    raise ValueError(f"checkpoint tensor {name!r} (model tensors {', '.join(parts)!r}) has shape "
                                     f"{tuple(tensor.shape)}, the model expects {want}")
                pieces = torch.split(tensor, [int(expected[p][0]) for p in parts], dim=0)
            else:
                pieces = (tensor,)
            for part, piece in zip(parts, pieces):
                state[part] = piece
                source_names[part] = name
    if args.tie_embeddings:
        emb = state.get("tok_embeddings.weight")
        if emb is not None:
            if lm_head is not None and not torch.equal(lm_head, emb):
                raise ValueError(
                    "checkpoint tensor 'lm_head.weight' differs from 'model.embed_tokens.weight' "
                    "but config.json sets tie_word_embeddings"
                )
            state["output.weight"] = emb
            source_names["output.weight"] = "model.embed_tokens.weight"
    # Errors about missing tensors speak Hugging Face names too (the layer count was checked above).
    source_names = {**{k: model_to_hf_name(k, layout) for k in expected}, **source_names}
    model, target = build_model(args, state, parse_dtype(dtype), source_names)
    stops, bos = _hf_stop_tokens(directory, config, args.vocab_size)
    return LoadedCheckpoint(
        model=model,
        source={"format": "hf", "dir": str(directory.resolve())},
        dtype=target,
        stop_token_ids=stops,
        bos_token_id=bos,
    )


def load_from_source(source: Mapping[str, object], dtype: "str | torch.dtype | None" = None) -> LoadedCheckpoint:
    """Reload what an export sidecar's ``source`` entry describes."""
    where = "the sidecar's source"
    fmt = json_field(source, "format", "str", where, None)
    if fmt == "meta":
        return load_meta(json_field(source, "checkpoint", "str", where), json_field(source, "params", "str", where),
                         dtype)
    if fmt == "hf":
        return load_hf(json_field(source, "dir", "str", where), dtype)
    if fmt == "gguf":
        from gguf_import import load_gguf  # imports this module: load late

        return load_gguf(json_field(source, "path", "str", where), dtype)
    raise ValueError(f"unknown checkpoint source format {fmt!r}")
