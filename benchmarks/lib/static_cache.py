"""Baseline 2: the example llama with its KV cache as in-graph static buffers.

Same weights, same AOTInductor compile path as offgraph-kv; only the owner of
the cache differs. Each attention layer holds ``k_cache`` / ``v_cache``
registered buffers ``[1, C, H_kv, D]`` (sequence-major, like the delegate's
storage) written in place with ``index_copy_`` at ``input_pos``.

Two ways to attend, both exported and measured:

- ``"mask"`` (the honest static cache, what stock exports do without a custom
  SDPA): attention over the whole capacity ``C`` with a lower-right causal mask
  ``key_pos <= query_pos``. Cost follows the capacity.
- ``"prefix"`` (a best-case static cache): attention over the first
  ``pos + T`` rows only (a data-dependent slice, ``input_pos[-1].item() + 1``).
  The memory is still the whole capacity; only the attention cost follows the
  used length, as ExecuTorch's ``sdpa_with_kv_cache`` custom op does.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

ATTEND_MODES = ("mask", "prefix")


class StaticCacheAttention(nn.Module):
    """Drop-in for ``model.Attention`` (shares its projection weights)."""

    def __init__(self, att: nn.Module, capacity: int, attend: str, fold_gqa: bool = False) -> None:
        super().__init__()
        if attend not in ATTEND_MODES:
            raise ValueError(f"attend must be one of {ATTEND_MODES}, got {attend!r}")
        self.wq, self.wk, self.wv, self.wo = att.wq, att.wk, att.wv, att.wo
        self.n_heads, self.n_kv_heads, self.head_dim = att.n_heads, att.n_kv_heads, att.head_dim
        self.capacity, self.attend, self.fold_gqa = int(capacity), attend, fold_gqa
        dtype = att.wk.weight.dtype
        self.register_buffer("k_cache", torch.zeros(1, capacity, att.n_kv_heads, att.head_dim, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(1, capacity, att.n_kv_heads, att.head_dim, dtype=dtype))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        from model import _rotate  # examples/llama/model.py (on sys.path, see artifacts.py)

        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        q = _rotate(q, cos, sin)
        k = _rotate(k, cos, sin).transpose(1, 2)  # back to [B, T, H_kv, D]
        idx = input_pos.view(-1)
        self.k_cache.index_copy_(1, idx, k)
        self.v_cache.index_copy_(1, idx, v)
        if self.attend == "prefix":
            used = input_pos[-1, 0].item() + 1
            torch._check(used >= 1)
            torch._check(used <= self.capacity)
            keys, values = self.k_cache[:, :used], self.v_cache[:, :used]
            key_pos = torch.arange(used, device=x.device)
        else:
            keys, values = self.k_cache, self.v_cache
            key_pos = torch.arange(self.capacity, device=x.device)
        mask = key_pos.view(1, -1) <= input_pos  # [T, L]: lower-right causal, rows past pos masked
        scale = 1.0 / math.sqrt(self.head_dim)
        if self.fold_gqa:
            # CUDA: a masked SDPA with enable_gqa falls back to the math kernel,
            # which repeats K/V per query head; folding each group's queries onto
            # the query axis keeps it on a fused kernel (cuDNN on the H200).
            g = self.n_heads // self.n_kv_heads
            qf = q.reshape(b, self.n_kv_heads, g * t, self.head_dim)
            out = F.scaled_dot_product_attention(
                qf, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask.repeat(g, 1), scale=scale,
            ).unflatten(2, (g, -1)).flatten(1, 2)  # (a view() here trips export's symbolic stride check)
        else:
            out = F.scaled_dot_product_attention(
                q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True,
            )
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


def static_cache_model(model: nn.Module, capacity: int, attend: str, fold_gqa: bool = False) -> nn.Module:
    """A copy of ``model`` (a ``model.Transformer``) whose layers own static KV buffers."""
    out = copy.deepcopy(model)
    for block in out.layers:
        block.attention = StaticCacheAttention(block.attention, capacity, attend, fold_gqa)
    return out.eval()
