"""Attention over the delegate's private storage, as the compiled step runs it.

Two forms. A one-token step over a flat store (decode) needs no mask: its
query sees every readable row, so it goes to a mask-free fused kernel. Any
other step (prefill chunks, ring bands) uses an explicit boolean mask. The
choice is made inside the compiled program (``torch.cond`` on the step width),
so one program serves both and the decode path never materialises a mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Which kernel a CUDA decode step with 16-bit storage calls. "sdpa" lets torch
# pick among its fused kernels at compile time (flash for bf16/fp16 without a
# mask); "cudnn" calls cuDNN's SDPA directly. Chosen from
# benchmarks/cuda_attention.py on the H200 (see README).
CUDA_DECODE_KERNEL = "sdpa"


def attention_dtype(storage: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype attention runs in.

    On CPU, fp32 (the oracle's own arithmetic). On CUDA, 16-bit storage is read
    as is: the fused SDPA kernels take 16-bit inputs and accumulate in fp32, and
    an fp32 copy of the whole history would triple the bytes a decode step moves.
    """
    if device.type == "cuda" and storage in (torch.bfloat16, torch.float16):
        return storage
    return torch.float32


def _fold_groups(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[1, H_q, T, D]`` -> ``[1, H_kv, G*T, D]``: each KV head's query group on
    the query axis, so every KV row is read once per KV head and no kernel ever
    sees a repeated copy of the history (query head h = kv * G + g)."""
    b, hq, t, d = q.shape
    # Dense first: reshaping a strided view makes export reason about (and
    # guard on) strides; the copy is T x H_q x D, nothing next to the history.
    return q.contiguous().view(b, num_kv_heads, (hq // num_kv_heads) * t, d)


def _unfold_groups(out: torch.Tensor, num_heads: int, t: int) -> torch.Tensor:
    return out.contiguous().view(out.shape[0], num_heads, t, out.shape[-1])


def _storage_views(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor):  # noqa: ANN202
    """``[1, S, H_kv, D]`` storage as ``[1, H_kv, S, D]`` views in the attention dtype."""
    compute = attention_dtype(k_store.dtype, q.device)
    return q.to(compute), k_store.transpose(1, 2).to(compute), v_store.transpose(1, 2).to(compute)


def attend_masked(
    q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, mask: torch.Tensor, scale: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Queries ``[1, H_q, T, D]`` over storage ``[1, S, H_kv, D]`` with a ``[T, S]`` boolean mask."""
    q, keys, values = _storage_views(q, k_store, v_store)
    hkv, t = keys.shape[1], q.shape[2]
    group = q.shape[1] // hkv
    out = F.scaled_dot_product_attention(_fold_groups(q, hkv), keys, values, attn_mask=mask.repeat(group, 1),
                                         scale=scale)
    return _unfold_groups(out, q.shape[1], t).to(out_dtype)


def attend_unmasked(
    q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, scale: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """Queries that see every row of the storage: no mask, so fused kernels apply."""
    q, keys, values = _storage_views(q, k_store, v_store)
    hkv, t = keys.shape[1], q.shape[2]
    folded = _fold_groups(q, hkv)
    if q.device.type == "cuda" and q.dtype != torch.float32 and CUDA_DECODE_KERNEL == "cudnn":
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(folded, keys, values, None, False, scale=scale)[0]
    else:
        out = F.scaled_dot_product_attention(folded, keys, values, scale=scale)
    return _unfold_groups(out, q.shape[1], t).to(out_dtype)


def causal_mask(t: int, s: int, device: torch.device) -> torch.Tensor:
    """Lower-right causal ``[T, S]``: query i (position s - t + i) sees keys up to its own position."""
    key_pos = torch.arange(s, device=device)
    query_pos = torch.arange(t, device=device) + (s - t)
    return key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)


def attend_flat(
    q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, scale: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """A flat layer's step after its write: the last T of the S rows are the step's own."""
    b, hq, t, _ = q.shape
    dv = v_store.shape[-1]

    # cond's branches must agree on output strides: both return a flat vector.
    def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend_unmasked(q, k, v, scale, out_dtype).reshape(-1)

    def chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend_masked(q, k, v, causal_mask(q.shape[2], k.shape[1], q.device), scale, out_dtype).reshape(-1)

    out = torch.cond(t == 1, decode, chunk, (q, k_store, v_store))
    return out.view(b, hq, t, dv)
