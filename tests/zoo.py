"""Decoders written the ways users write them, none shaped like examples/llama/model.py.

Every model here calls ``kvcache::update_and_attend`` but differs in what the
partitioner and runtime must not assume: argument order, where the RoPE tables
come from, what is returned, extra inputs, fused projections, tied embeddings,
layers that differ from each other, and the layout of positions. Each is built
from one small core so that a zoo entry states only what it changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import executorch.extension.llm.cache.update_and_attend  # noqa: F401  (registers the op)
from executorch.extension.llm.cache.reference_cache import CacheConfig, ContiguousReferenceCache, LayerPolicy


@dataclass(frozen=True)
class LayerShape:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: int = 0  # 0: head_dim
    # 0: RoPE over the whole head as ``x * cos + rotate_half(x) * sin``; else the
    # GPT-NeoX / Phi form: the first ``rotary_dim`` dims rotated, the rest passed
    # through by ``torch.cat`` (an empty tail when it equals head_dim).
    rotary_dim: int = 0

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim


@dataclass(frozen=True)
class ZooConfig:
    vocab: int = 96
    dim: int = 48
    hidden: int = 96
    layers: Tuple[LayerShape, ...] = (LayerShape(4, 2, 12), LayerShape(4, 2, 12), LayerShape(4, 2, 12))
    fused_qkv: bool = False
    tied: bool = False
    theta: float = 10000.0
    # The op's layer_id is block index x this: 2 gives ids 0, 2, 4, as a hybrid
    # model passes its block index when only some blocks attend.
    layer_id_stride: int = 1
    # GPT-J / Meta-Llama RoPE: adjacent pairs (2i, 2i+1) rotated, written with unbind / stack /
    # flatten; and the query scaled before the op (the op's scale then 1.0), as some ports write it.
    interleaved_rope: bool = False

    @property
    def n_layers(self) -> int:
        return len(self.layers)


def rope_tables(pos: torch.Tensor, head_dim: int, theta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, head_dim]`` (halves repeated) for positions of any shape holding T values."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = pos.reshape(-1, 1).to(torch.float32) * inv
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class ZooAttention(nn.Module):
    def __init__(self, cfg: ZooConfig, layer_id: int) -> None:
        super().__init__()
        s = cfg.layers[layer_id]
        self.layer_id, self.s = layer_id * cfg.layer_id_stride, s
        q, kv, vv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.n_kv_heads * s.v_dim
        if cfg.fused_qkv:
            self.qkv = nn.Linear(cfg.dim, q + kv + vv, bias=True)
        else:
            self.q, self.k, self.v = (nn.Linear(cfg.dim, n, bias=False) for n in (q, kv, vv))
        self.o = nn.Linear(s.n_heads * s.v_dim, cfg.dim, bias=False)
        self.fused = cfg.fused_qkv
        self.interleaved = cfg.interleaved_rope

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, op_pos: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        s = self.s
        if self.fused:
            q, k, v = self.qkv(x).split([s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim,
                                          s.n_kv_heads * s.v_dim], dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q = q.view(1, t, s.n_heads, s.head_dim).transpose(1, 2)
        k = k.view(1, t, s.n_kv_heads, s.head_dim).transpose(1, 2)
        v = v.view(1, t, s.n_kv_heads, s.v_dim).transpose(1, 2)
        scale = s.head_dim ** -0.5
        if self.interleaved:
            half_cos, half_sin = cos[..., : s.head_dim // 2], sin[..., : s.head_dim // 2]

            def rotate_pairs(z: torch.Tensor) -> torch.Tensor:
                a, b = z.reshape(*z.shape[:-1], -1, 2).unbind(-1)
                return torch.stack([a * half_cos - b * half_sin, a * half_sin + b * half_cos], -1).flatten(-2)

            q, k = rotate_pairs(q) * scale, rotate_pairs(k)
            scale = 1.0
        elif s.rotary_dim:
            rd = s.rotary_dim
            q = torch.cat([q[..., :rd] * cos + _rotate_half(q[..., :rd]) * sin, q[..., rd:]], dim=-1)
            k = torch.cat([k[..., :rd] * cos + _rotate_half(k[..., :rd]) * sin, k[..., rd:]], dim=-1)
        else:
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        out = torch.ops.kvcache.update_and_attend(q, k, v, op_pos, self.layer_id, scale, x.dtype)
        return self.o(out.transpose(1, 2).reshape(1, t, -1))


class ZooBlock(nn.Module):
    def __init__(self, cfg: ZooConfig, layer_id: int) -> None:
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(cfg.dim, eps=1e-6), nn.RMSNorm(cfg.dim, eps=1e-6)
        self.attn = ZooAttention(cfg, layer_id)
        self.up = nn.Linear(cfg.dim, 2 * cfg.hidden, bias=False)  # gate and up fused
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, op_pos: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x), cos, sin, op_pos)
        g, u = self.up(self.n2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class ZooCore(nn.Module):
    """Embedding, blocks, norm and head; the zoo entries wrap it with their own forward."""

    def __init__(self, cfg: ZooConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(ZooBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=1e-6)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tied:
            self.head.weight = self.embed.weight
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]) + (1.0 if p.dim() == 1 and p.shape[0] == cfg.dim else 0.0))

    def tables(self, pos: torch.Tensor, layer_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
        s = self.cfg.layers[layer_id]
        return rope_tables(pos, s.rotary_dim or s.head_dim, self.cfg.theta)

    def run(self, x: torch.Tensor, pos: torch.Tensor, op_pos: torch.Tensor,
            tables: "Sequence[Tuple[torch.Tensor, torch.Tensor]] | None" = None) -> torch.Tensor:
        """The hidden state after the final norm; ``tables`` per layer, else computed from ``pos``."""
        for i, block in enumerate(self.blocks):
            cos, sin = tables[i] if tables is not None else self.tables(pos, i)
            x = block(x, cos, sin, op_pos)
        return self.norm(x)


# --------------------------------------------------------------------------- #
# Zoo entries: each forward is one way users write a decoder.
# --------------------------------------------------------------------------- #


class PosFirst(ZooCore):
    """``forward(pos [T, 1], tokens [1, T])``: positions before tokens."""

    def forward(self, pos: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.run(self.embed(tokens), pos, pos)).float()


class RopeBeforeEmbedding(ZooCore):
    """``forward(tokens, pos)`` but RoPE tables are computed from ``pos`` before the
    embedding, and only the last position's logits are returned (the issue's model)."""

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        tables = [self.tables(pos, i) for i in range(self.cfg.n_layers)]
        h = self.run(self.embed(tokens), pos, pos, tables)
        return self.head(h[:, -1, :]).float()


class CosSinInputs(ZooCore):
    """``forward(tokens, cos [T, D], sin [T, D], pos)``: precomputed tables as inputs
    (every layer must share one head dim); logits and the final hidden state."""

    def forward(self, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                pos: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        h = self.run(self.embed(tokens), pos, pos, [(cos, sin)] * self.cfg.n_layers)
        return self.head(h).float(), h


class ExtraInputs(ZooCore):
    """``forward(flag [1], tokens, pos, scale [1])``: ``scale`` multiplies the embedding
    (the partition uses it), ``flag`` is unused (export drops it from the delegate)."""

    def forward(self, flag: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor,
                scale: torch.Tensor) -> torch.Tensor:
        return self.head(self.run(self.embed(tokens) * scale, pos, pos)).float()


class FlatPositions(ZooCore):
    """``forward(tokens, pos [T])``: 1-D positions, reshaped to the op's ``[T, 1]``."""

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.head(self.run(self.embed(tokens), pos, pos.unsqueeze(-1))).float()


class RowPositions(ZooCore):
    """``forward(tokens, pos [1, T])``: HF-style position ids, transposed for the op."""

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.head(self.run(self.embed(tokens), pos, pos.transpose(0, 1))).float()


class RowPositionsToOp(ZooCore):
    """Passes ``[1, T]`` positions straight to the op, whose contract is ``[T, n_dims]``:
    must fail at export, naming the layout expected."""

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.head(self.run(self.embed(tokens), pos, pos)).float()


# --------------------------------------------------------------------------- #
# Inputs per entry, and the oracle
# --------------------------------------------------------------------------- #

POSITION_LAYOUTS = {"column": lambda p: p.unsqueeze(-1), "flat": lambda p: p, "row": lambda p: p.unsqueeze(0)}


@dataclass
class Entry:
    """A zoo model and how its inputs are made for a step."""

    name: str
    cls: type
    cfg: ZooConfig
    order: Tuple[str, ...]          # input names in forward order
    positions: str = "column"       # layout of the positions input
    layers: Tuple[LayerPolicy, ...] = (LayerPolicy.flat(),)
    storage: torch.dtype = torch.float32
    what: str = ""
    export_error: str = ""          # a substring of the expected export error, if export must fail
    static_width: bool = False      # exported for one-token steps only (a decode-only program)
    extras: Dict[str, float] = field(default_factory=dict)

    def model(self) -> ZooCore:
        return self.cls(self.cfg).eval()

    def inputs(self, tokens: torch.Tensor, start: int) -> Tuple[torch.Tensor, ...]:
        t = tokens.shape[1]
        pos = torch.arange(start, start + t, dtype=torch.long)
        cos, sin = rope_tables(pos, self.cfg.layers[0].head_dim, self.cfg.theta)
        values = {
            "tokens": tokens, "pos": POSITION_LAYOUTS[self.positions](pos), "cos": cos, "sin": sin,
            "flag": torch.ones(1), "scale": torch.full((1,), self.extras.get("scale", 1.0)),
        }
        return tuple(values[n] for n in self.order)

    def example(self) -> Tuple[torch.Tensor, ...]:
        return self.inputs(torch.zeros(1, 1 if self.static_width else 4, dtype=torch.long), 0)

    def dynamic_shapes(self, max_write: int) -> "Tuple[object, ...] | None":
        if self.static_width:
            return None
        t = torch.export.Dim("t", min=1, max=max_write)
        dims = {"tokens": {1: t}, "cos": {0: t}, "sin": {0: t}, "flag": None, "scale": None,
                "pos": {"column": {0: t}, "flat": {0: t}, "row": {1: t}}[self.positions]}
        return tuple(dims[n] for n in self.order)


class PerLayerReference:
    """The oracle for layers that differ in heads or head dim: one
    ``ContiguousReferenceCache`` per layer (its config is one shape for all layers)."""

    def __init__(self, cfg: ZooConfig, layers: Sequence[LayerPolicy], dtype: torch.dtype, capacity: int = 1024) -> None:
        pol = list(layers) * (cfg.n_layers if len(layers) == 1 else 1)
        self.stride = cfg.layer_id_stride
        self.caches = [
            ContiguousReferenceCache(CacheConfig(n_layers=1, n_kv_heads=s.n_kv_heads, head_dim=s.head_dim,
                                                 capacity=capacity, dtype=dtype, layers=(pol[i],)))
            for i, s in enumerate(cfg.layers)
        ]
        # The reference appends to an empty history shaped by its one head_dim;
        # a value head dim of its own (which the op allows) needs its own.
        for c, s in zip(self.caches, cfg.layers):
            c._v[0] = torch.zeros(1, s.n_kv_heads, 0, s.v_dim, dtype=dtype)

    def update_and_fetch(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor):  # noqa: ANN201
        return self.caches[layer_id // self.stride].update_and_fetch(0, k, v, position)


def outputs(result: object) -> List[torch.Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]
