"""A Llama-family decoder whose attention calls ``kvcache::update_and_attend``.

One definition serves export (the op is functional to the tracer, so the KV cache
never becomes a graph tensor) and the eager reference (the op dispatches to the
``ContiguousReferenceCache`` installed in ExecuTorch's cache registry).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

# Importing registers the op with torch.library.
import executorch.extension.llm.cache.update_and_attend  # noqa: F401
from executorch.extension.llm.cache.reference_cache import LayerPolicy


@dataclass
class ModelArgs:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    vocab_size: int = 256
    hidden_dim: Optional[int] = None
    multiple_of: int = 32
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # RoPE frequency scaling; None keeps plain RoPE. ``rope_type`` "llama3" (Llama 3.1: the
    # default when absent, as sidecars written before other types existed hold) or "linear"
    # (every frequency divided by ``factor``).
    rope_scaling: Optional[Dict[str, "float | str"]] = None
    # Per-layer sliding windows: 0 = full attention. One entry applies to all
    # layers, otherwise one per layer.
    sliding_windows: List[int] = field(default_factory=lambda: [0])
    tie_embeddings: bool = False
    # Set when heads are not dim / n_heads wide (e.g. a narrow residual stream
    # with Llama-3-8B-sized attention, as the CUDA benchmark uses).
    attention_head_dim: Optional[int] = None
    # Biases of the q/k/v projections (Qwen2) and of the output projection
    # (Llama's attention_bias sets both).
    qkv_bias: bool = False
    out_bias: bool = False
    # Biases of the MLP's gate/up/down projections (Llama's mlp_bias).
    mlp_bias: bool = False
    # Qwen3: an RMSNorm over each head of q and of k (weights [head_dim]) before RoPE;
    qk_norm: bool = False
    # with qk_norm_full, one RMSNorm over all of q's heads and one over all of k's (OLMo 2: weights
    # [n_heads * head_dim] and [n_kv_heads * head_dim]), on the projections as they come out.
    qk_norm_full: bool = False
    # False: no norm before the attention and the MLP (OLMo 2 normalises only their outputs, with
    # sandwich_norms); Llama's blocks normalise their inputs.
    pre_norms: bool = True
    # The RMSNorm weight multiplies in fp32 before the cast back to the input's dtype (OLMo 2's order,
    # and Gemma's with norm_offset); Llama casts, then multiplies.
    norm_fp32_weight: bool = False
    # The Gemma family's differences from Llama, each off by default:
    # RMSNorm scales by (1 + weight), multiplied in fp32 before the cast back (Gemma's order);
    norm_offset: bool = False
    # the embeddings are multiplied by sqrt(dim), rounded to the weights' dtype as transformers rounds it;
    embed_scale: bool = False
    # the MLP's gate activation: "silu" (Llama), "gelu" (exact erf) or "gelu_tanh" (Gemma's gelu_pytorch_tanh);
    mlp_act: str = "silu"
    # Gemma 2/3: the attention's and the MLP's outputs are normalised again before each residual add;
    sandwich_norms: bool = False
    # the softmax scale (None: 1/sqrt(head_dim); Gemma 2/3: query_pre_attn_scalar ** -0.5);
    attention_scale: Optional[float] = None
    # the RoPE base of sliding-window (ring) layers where it is not rope_theta (Gemma 3: 10,000 there,
    # 1e6 on full layers); rope_scaling then applies to the full layers only;
    local_rope_theta: Optional[float] = None
    # logits = cap * tanh(logits / cap) (Gemma 2's final_logit_softcapping).
    final_logit_softcap: Optional[float] = None
    # Granite's multipliers (None: none): the embeddings times embedding_multiplier, each sublayer's
    # output times residual_multiplier before its residual add, the logits divided by logits_scaling,
    # each in the weights' dtype with a Python number, as transformers computes them.
    embedding_multiplier: Optional[float] = None
    residual_multiplier: Optional[float] = None
    logits_scaling: Optional[float] = None
    # SmolLM3's NoPE layers: these layer indices rotate neither q nor k (position reaches them only
    # through the causal order the cache keeps).
    nope_layers: List[int] = field(default_factory=list)
    # False: logits of each step's last token only, [1, 1, vocab] (what
    # generation reads; ExecuTorch's export_llama default): a prefill chunk
    # then runs the output projection, the largest matrix of a small model, on
    # one row instead of every row, and hands back vocab floats, not T x vocab.
    full_logits: bool = True

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def window_of(self, layer: int) -> int:
        w = self.sliding_windows
        return w[0] if len(w) == 1 else w[layer]

    def layer_policies(self) -> List[LayerPolicy]:
        """The cache policy of every layer, as the oracle and partitioner take it."""
        return [
            LayerPolicy.ring(self.window_of(i)) if self.window_of(i) > 0 else LayerPolicy.flat()
            for i in range(self.n_layers)
        ]

    def to_dict(self) -> dict:
        return asdict(self)


MLP_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def _rope_inverse_frequencies(args: ModelArgs, local: bool = False) -> torch.Tensor:
    """RoPE's inverse frequencies of the full layers, or with ``local`` of the sliding-window layers
    (``local_rope_theta``, unscaled, where it is set)."""
    d = args.head_dim
    local = local and args.local_rope_theta is not None
    theta = args.local_rope_theta if local else args.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = None if local else args.rope_scaling
    if not s:
        return inv.float()
    rope_type = s.get("rope_type", "llama3")
    if rope_type == "linear":
        # Positions divided by the factor: the same angles as frequencies divided by it.
        return (inv / float(s["factor"])).float()
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling rope_type {rope_type!r} is not supported (only 'llama3' and 'linear')")
    # Llama 3.1: stretch low frequencies, keep high ones, blend in between.
    factor = s.get("factor", 8.0)
    low = s.get("low_freq_factor", 1.0)
    high = s.get("high_freq_factor", 4.0)
    old_ctx = s.get("original_max_position_embeddings", 8192)
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(
        wavelen > low_wavelen,
        inv / factor,
        torch.where(wavelen < high_wavelen, inv, (1 - smooth) * inv / factor + smooth * inv),
    )
    return scaled.float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: bool = False, fp32_weight: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.fp32_weight = fp32_weight or offset
        # An offset norm's identity is a zero weight (Gemma stores weight - 1).
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    @classmethod
    def of(cls, args: ModelArgs, dim: int) -> "RMSNorm":
        """The norm ``args``' family computes, over ``dim`` features."""
        return cls(dim, args.norm_eps, args.norm_offset, args.norm_fp32_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.fp32_weight:  # Gemma / OLMo 2 multiply in fp32, then cast; Llama casts, then multiplies
            return (out * ((1.0 + self.weight.float()) if self.offset else self.weight.float())).to(x.dtype)
        return out.to(x.dtype) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Half-split rotation (the Hugging Face convention); Meta checkpoints are
    # permuted into it at load.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.out_bias)
        # Only created when used, so models without them keep their parameters and graphs.
        if args.qk_norm:
            full = args.qk_norm_full
            self.q_norm = RMSNorm.of(args, args.head_dim * (args.n_heads if full else 1))
            self.k_norm = RMSNorm.of(args, args.head_dim * (args.n_kv_heads if full else 1))
        # "head": per head, after the split (Qwen3); "full": over the whole projection, before it (OLMo 2).
        self.qk_norm = ("full" if args.qk_norm_full else "head") if args.qk_norm else None
        self.scale = args.attention_scale if args.attention_scale is not None else 1.0 / math.sqrt(args.head_dim)
        self.rope = layer_id not in args.nope_layers

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k = self.wq(x), self.wk(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm == "head":  # over head_dim, per head and token; before RoPE, as Qwen3 normalises
            q = self.q_norm(q)
            k = self.k_norm(k)
        if self.rope:
            q = _rotate(q, cos, sin)
            k = _rotate(k, cos, sin)
        out = torch.ops.kvcache.update_and_attend(
            q, k, v, input_pos, self.layer_id, self.scale, x.dtype
        )
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=args.mlp_bias)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=args.mlp_bias)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=args.mlp_bias)
        if args.mlp_act not in MLP_ACTIVATIONS:
            raise ValueError(f"mlp_act {args.mlp_act!r} is not one of {MLP_ACTIVATIONS}")
        self.act = args.mlp_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x)
        if self.act == "silu":
            gate = F.silu(gate)
        else:
            gate = F.gelu(gate, approximate="tanh" if self.act == "gelu_tanh" else "none")
        return self.w2(gate * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.attention = Attention(args, layer_id)
        self.feed_forward = FeedForward(args)
        # Only the norms the family has are created, so each checkpoint's tensors map one to one.
        if args.pre_norms:
            self.attention_norm = RMSNorm.of(args, args.dim)
            self.ffn_norm = RMSNorm.of(args, args.dim)
        if args.sandwich_norms:
            self.post_attention_norm = RMSNorm.of(args, args.dim)
            self.post_ffn_norm = RMSNorm.of(args, args.dim)
        self.pre = args.pre_norms
        self.sandwich = args.sandwich_norms
        self.residual_multiplier = args.residual_multiplier

    def _to_residual(self, out: torch.Tensor, post_norm: str) -> torch.Tensor:
        if self.sandwich:
            out = getattr(self, post_norm)(out)
        return out if self.residual_multiplier is None else out * self.residual_multiplier

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        a = self.attention(self.attention_norm(x) if self.pre else x, cos, sin, input_pos)
        h = x + self._to_residual(a, "post_attention_norm")
        return h + self._to_residual(self.feed_forward(self.ffn_norm(h) if self.pre else h), "post_ffn_norm")


class Transformer(nn.Module):
    """``forward(tokens [1, T] int64, input_pos [T, 1] int64) -> logits [1, T, vocab] fp32``
    (``[1, 1, vocab]``, the last token's, when ``args.full_logits`` is False)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm.of(args, args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("inv_freq", _rope_inverse_frequencies(args), persistent=False)
        # Only with a local RoPE base, so other models keep their buffers and graphs.
        if args.local_rope_theta is not None:
            self.register_buffer("inv_freq_local", _rope_inverse_frequencies(args, local=True), persistent=False)
        # sqrt(dim) as each weight dtype holds it (transformers multiplies by it in that dtype), taken
        # now: a Python number under export, not a tensor created while tracing.
        self._embed_scales = {dt: torch.tensor(math.sqrt(args.dim), dtype=dt, device="cpu").item()
                              for dt in (torch.float32, torch.bfloat16, torch.float16)} if args.embed_scale else {}

    def reset_rope(self) -> None:
        """Recompute the RoPE frequency buffers (fp32) on the model's device (they are not weights:
        a model built on the meta device, or cast, gets them back here)."""
        device = self.tok_embeddings.weight.device
        device = torch.device("cpu") if device.type == "meta" else device
        self.inv_freq = _rope_inverse_frequencies(self.args).to(device)
        if self.args.local_rope_theta is not None:
            self.inv_freq_local = _rope_inverse_frequencies(self.args, local=True).to(device)

    def _apply(self, fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        super()._apply(fn, *args, **kwargs)
        # RoPE frequencies stay fp32 whatever dtype the weights are cast to: in
        # bf16 (8 significant bits) a frequency is off by up to 0.4 %, a phase
        # error that grows with the position (~0.3 rad by position 165 at the
        # highest frequency). The angles and their cos/sin are computed in fp32.
        if self.inv_freq.dtype != torch.float32:
            self.reset_rope()
        return self

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        if self._embed_scales:
            x = x * self._embed_scales.get(x.dtype, math.sqrt(self.args.dim))
        if self.args.embedding_multiplier is not None:
            x = x * self.args.embedding_multiplier
        pos = input_pos.to(torch.float32)
        angles = pos * self.inv_freq  # [T, head_dim / 2]
        rope = (angles.cos().to(x.dtype), angles.sin().to(x.dtype))
        local = rope
        if self.args.local_rope_theta is not None:
            angles = pos * self.inv_freq_local
            local = (angles.cos().to(x.dtype), angles.sin().to(x.dtype))
        for i, layer in enumerate(self.layers):
            cos, sin = local if self.args.window_of(i) > 0 else rope
            x = layer(x, cos, sin, input_pos)
        if not self.args.full_logits:
            x = x[:, -1:]
        logits = self.output(self.norm(x))
        if self.args.logits_scaling is not None:
            logits = logits / self.args.logits_scaling
        cap = self.args.final_logit_softcap
        if cap is not None:  # in the weights' dtype, as transformers caps them
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


def init_deterministic(model: Transformer, seed: int = 0) -> Transformer:
    """Small random weights from a fixed seed: a model that needs no download."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(0.0 if model.args.norm_offset else 1.0)  # the identity norm
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / math.sqrt(p.shape[-1])))
    return model


def positions(start: int, width: int) -> torch.Tensor:
    """The ``input_pos`` tensor for a step of ``width`` tokens starting at ``start``."""
    return torch.arange(start, start + width, dtype=torch.long).unsqueeze(-1)


def example_inputs(width: int = 4) -> tuple:
    return (torch.zeros(1, width, dtype=torch.long), positions(0, width))


def dynamic_shapes(max_write: int) -> dict:
    t = torch.export.Dim("tokens", min=1, max=max_write)
    return {"tokens": {1: t}, "input_pos": {0: t}}
