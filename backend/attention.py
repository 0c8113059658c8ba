"""Attention over the delegate's private storage, as the compiled step runs it.

A flat layer's step never builds a mask over its history. (CUDA programs with
16-bit storage attend through our own kernels instead, ``triton_attention.py``,
unless exported with ``OFFGRAPH_KV_CUDA_ATTENTION=torch``; what follows is every
other program's path.)

- CUDA, 16-bit storage: one flash-attention call over all S rows with flash's
  own causal flag, which the kernel aligns lower-right when T < S (query i
  sees rows up to S - T + i) and drops for a one-token step. A decode step is
  one split-KV kernel per layer over K/V in the store's own layout, GQA
  native: no copy of the queries, nothing after the kernel.
- CPU: one call of our kernel per step, any width (``cpu_kernels.py``,
  ``offgraph_kv::rows_attend_causal``): the stored rows read as stored (fp32,
  bf16 or fp16), each read once for every query of its KV head, the step's own
  rows masked lower-right by row arithmetic. A decode step reads the rows in
  registers (a bf16-KV SmolLM2 step at 8,000 rows took 0.73x the reductions'
  time, benchmarks/results/cpu_attention_bandwidth.md); a wider step widens
  each block once into scratch and runs register tiles over it, which also
  removed the fp32 copy of the rows that ATen's fused kernel needed.
  (``OFFGRAPH_KV_CPU_ATTENTION`` keeps the earlier lowerings below.)
- CUDA fp32, and CPU under the earlier lowerings (this op's fp32 kernel,
  efficient attention, aligns its causal mask upper-left): the T queries all
  see the history and the step's first row, so that part goes to a mask-free
  fused kernel that also returns each query's log-sum-exp; the step's other
  T - 1 rows (a strictly lower triangle, T x T at most) are attended directly
  and merged by log-sum-exp. (CPU decode under ``direct``: reductions that
  widen each 16-bit element as it is loaded, ``reduced_attention_with_lse``.)

Either way one program serves every step width (the earlier CPU lowerings'
choice is a ``torch.cond`` on the width, a branch in the compiled code); the
masked kernels would run at 2-3 % of memory bandwidth at 32K context on the
H200. Ring layers keep an explicit band mask: their window is small.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

import offgraph_kv.backend.cpu_kernels  # noqa: F401  (registers offgraph_kv::rows_attend_causal)
from offgraph_kv.backend.switches import switch
from offgraph_kv.backend.width_branch import by_width


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
    # An explicit clone, not .contiguous(): a query built by ``torch.cat`` keeps
    # its inputs' head-strided layout, and export drops a contiguous() it thinks
    # is a no-op, which leaves the view below unable to take the tensor.
    dense = q.clone(memory_format=torch.contiguous_format)
    return dense.view(b, num_kv_heads, (hq // num_kv_heads) * t, d)


def _unfold_groups(out: torch.Tensor, num_heads: int, t: int) -> torch.Tensor:
    # An explicit dense copy, not .contiguous(): export drops a contiguous() that
    # is a no-op on the tracing device, but CUDA's efficient kernel (fp32) returns
    # a head-strided output that the view below cannot take. Inductor fuses the
    # copy into the kernel that produces ``out``.
    dense = out.clone(memory_format=torch.contiguous_format)
    return dense.view(out.shape[0], num_heads, t, out.shape[-1])


def _storage_views(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, convert: bool = True):  # noqa: ANN202
    """``[1, S, H_kv, D]`` storage as ``[1, H_kv, S, D]`` views in the attention dtype
    (``convert=False``: the storage's own dtype; the caller widens only what it reads)."""
    compute = attention_dtype(k_store.dtype, q.device)
    keys, values = k_store.transpose(1, 2), v_store.transpose(1, 2)
    if convert:
        keys, values = keys.to(compute), values.to(compute)
    return q.to(compute), keys, values


def _explicit_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                        mask: "torch.Tensor | None" = None) -> "tuple[torch.Tensor, torch.Tensor]":
    """Attention written out (and its fp32 log-sum-exp), for value head dims that
    differ from the key's: torch's fused CPU kernels require them equal."""
    logits = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    # A fully masked row (an empty ring slot band) has lse -inf: give it zeros, not NaN.
    weights = torch.exp(logits - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.matmul(weights, values.float()).to(q.dtype), lse


def attend_masked(
    q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, mask: torch.Tensor, scale: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Queries ``[1, H_q, T, D]`` over storage ``[1, S, H_kv, D]`` with a ``[T, S]`` boolean mask."""
    q, keys, values = _storage_views(q, k_store, v_store)
    hkv, t = keys.shape[1], q.shape[2]
    group = q.shape[1] // hkv
    if values.shape[-1] != keys.shape[-1]:
        out = _explicit_attention(_fold_groups(q, hkv), keys, values, scale, mask.repeat(group, 1))[0]
    else:
        out = F.scaled_dot_product_attention(_fold_groups(q, hkv), keys, values, attn_mask=mask.repeat(group, 1),
                                             scale=scale)
    return _unfold_groups(out, q.shape[1], t).to(out_dtype)


def fused_attention_with_lse(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> "tuple[torch.Tensor, torch.Tensor]":
    """Unmasked fused attention, and the fp32 log-sum-exp of each query row
    (CPU, and CUDA fp32; CUDA 16-bit steps take ``flash_lower_right_causal``).

    What ``offgraph_kv::attend_with_lse`` decomposes into at compile time.
    """
    if values.shape[-1] != keys.shape[-1]:
        return _explicit_attention(q, keys, values, scale)
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, keys, values, None, True,
                                                                          scale=scale)[:2]
        return out, lse[..., : q.shape[2]]  # the kernel pads its rows to a multiple of 32
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys, values, scale=scale)


# The kernel choice stays behind ops of our own until compile time: CUDA's
# flash op also returns SymInts, which torch 2.11's export serialiser cannot
# write, and the program is serialised to reach the compiling process. That
# process decomposes the ops (see COMPILE_DECOMPOSITIONS) right before AOTI.
_LIB = torch.library.Library("offgraph_kv", "DEF")
_LIB.define("attend_with_lse(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)")
_LIB.impl("attend_with_lse", fused_attention_with_lse, "CompositeExplicitAutograd")


@torch.library.register_fake("offgraph_kv::attend_with_lse")
def _attend_with_lse_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):  # noqa: ANN202
    rows = q.shape[:-1]
    return q.new_empty((*rows, v.shape[-1])), q.new_empty(rows, dtype=torch.float32)


def flash_lower_right_causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """CUDA flash attention, 16-bit, GQA native (no repeated K/V), causal aligned lower-right.

    What ``offgraph_kv::attend_causal`` decomposes into at compile time.
    """
    return torch.ops.aten._scaled_dot_product_flash_attention(q, keys, values, is_causal=True, scale=scale)[0]


_LIB.define("attend_causal(Tensor q, Tensor k, Tensor v, float scale) -> Tensor")
_LIB.impl("attend_causal", flash_lower_right_causal, "CompositeExplicitAutograd")


@torch.library.register_fake("offgraph_kv::attend_causal")
def _attend_causal_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # Flash's own output layout ([B, T, H, D] seen as [B, H, T, D]), so the
    # traced program reshapes it for the output projection without a copy.
    b, h, t, _ = q.shape
    return q.new_empty((b, t, h, v.shape[-1])).transpose(1, 2)


COMPILE_DECOMPOSITIONS = {
    torch.ops.offgraph_kv.attend_with_lse.default: fused_attention_with_lse,
    torch.ops.offgraph_kv.attend_causal.default: flash_lower_right_causal,
}


def reduced_attention_with_lse(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> "tuple[torch.Tensor, torch.Tensor]":
    """Unmasked attention of fp32 queries over 16-bit keys and values, in fp32,
    written as reductions that inductor fuses with the loads: each stored
    element is widened in a register as it is read, so no fp32 copy of the
    history exists. Returns the fp32 output and each query row's log-sum-exp.

    For the few query rows of a decode step this reads the history once at
    the storage's width (half of fp32's bytes); it is not a GEMM, so wide
    steps take the fused kernel instead (``_history_16bit``).
    """
    logits = (q.unsqueeze(3) * keys.unsqueeze(2).float()).sum(-1) * scale  # [1, H_kv, R, S]
    p, total, lse = _softmax_parts(logits)
    out = (p.unsqueeze(-1) * values.unsqueeze(2).float()).sum(-2) / total
    return out, lse


def _softmax_parts(logits: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
    """Unnormalised weights over the last dim, their sum (kept) and the log-sum-exp: the
    reductions' softmax, left unnormalised so the division happens once per output row."""
    peak = logits.amax(-1, keepdim=True)
    p = torch.exp(logits - peak)
    total = p.sum(-1, keepdim=True)
    return p, total, (peak + torch.log(total)).squeeze(-1)


def grouped_decode_attention_with_lse(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                                      groups: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """``reduced_attention_with_lse`` for a one-token step, the ``groups`` query
    rows of each KV head written out one by one: inductor then fuses them into
    one pass over the history with ``groups`` accumulators, so each stored row
    is loaded and widened once for all of them (the row-batched form reads it
    once per query row, one horizontal sum at a time).

    Valid only when each KV head has exactly ``groups`` query rows (T == 1);
    the result is laid out for any T so that both branches of the width's
    ``torch.cond`` agree in shape.
    """
    r = q.shape[2]
    qf = q.float()
    kf, vf = keys.float(), values.float()
    logits = torch.stack([(qf[:, :, g].unsqueeze(2) * kf).sum(-1) for g in range(groups)], 2) * scale
    p, total, lse = _softmax_parts(logits)
    out = torch.stack([(p[:, :, g].unsqueeze(-1) * vf).sum(2) for g in range(groups)], 2) / total
    # [1, H_kv, G, ...] -> the caller's G*T rows (index r % G: row r itself when T == 1,
    # the only case this branch runs; any T keeps the shape both cond branches share).
    rows = torch.arange(r, device=q.device) % groups
    return out.index_select(2, rows), lse.index_select(2, rows)


def _dense(*tensors: torch.Tensor) -> "tuple[torch.Tensor, ...]":
    # Both branches of a cond must return one layout (AOTI refuses differing
    # strides; the fused kernel's lse is head-strided); the copies are T rows.
    return tuple(x.clone(memory_format=torch.contiguous_format) for x in tensors)


def _converted_attention_with_lse(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                                  ) -> "tuple[torch.Tensor, torch.Tensor]":
    return _dense(*torch.ops.offgraph_kv.attend_with_lse(q, keys.float(), values.float(), scale))


def _reduced_branch(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, groups: int,
                    ) -> "tuple[torch.Tensor, torch.Tensor]":
    if _cpu_decode_lowering() == "grouped":
        out, lse = grouped_decode_attention_with_lse(q, keys, values, scale, groups)
    else:
        out, lse = reduced_attention_with_lse(q, keys, values, scale)
    return _dense(out.to(q.dtype), lse)


def _history_16bit(step_width: "int | torch.SymInt", q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scale: float, groups: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """CPU, 16-bit storage: attention over the rows every query sees.

    A one-token step (decode) reads the 16-bit rows directly
    (``reduced_attention_with_lse``): converting the whole history to fp32
    first wrote and re-read twice its bytes every step, more than the
    attention itself. A wider step (prefill chunk) converts the rows it sees
    and runs the fused fp32 kernel: there the conversion is shared by all its
    queries and the kernel's GEMMs are 1.5x faster than reductions (measured:
    64 queries over 2,000 rows, 3 KV heads). One program serves both, so the
    choice is a ``torch.cond`` on the width, a branch in the compiled code.
    """
    return by_width(step_width, lambda a, b, c: _reduced_branch(a, b, c, scale, groups),
                    lambda a, b, c: _converted_attention_with_lse(a, b, c, scale), (q, keys, values))


# ``OFFGRAPH_KV_CPU_ATTENTION`` (read at export) picks the CPU lowering of a
# flat layer's step: ``rows`` (the default), our kernel over the stored rows
# for every width (``cpu_kernels.py``), any storage dtype; the others keep
# ATen's fused kernel for wide steps and fp32 decode and, for 16-bit decode,
# ``direct`` (the reductions
# above); ``grouped``, ``grouped_decode_attention_with_lse`` (8 SmolLM2-shaped
# layers, in turns: 1.03x / 1.00x / 0.81x direct's decode step at 200 / 2,000 /
# 8,000 rows, benchmarks/results/cpu_attention_grouped.json); ``convert``, the
# whole history converted to fp32 every step. Kept side by side for
# benchmarks/cpu/attention_16bit.py and attention_bandwidth.py.
CPU_ENV_SWITCH = "OFFGRAPH_KV_CPU_ATTENTION"
CPU_DECODE_LOWERINGS = ("rows", "direct", "grouped", "convert")


def _cpu_decode_lowering() -> str:
    return switch(CPU_ENV_SWITCH, CPU_DECODE_LOWERINGS, "rows")


def _cpu_reads_16bit() -> bool:
    return _cpu_decode_lowering() != "convert"


def attend_flat(
    q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, scale: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """A flat layer's step after its write: the last T of the S rows are the step's own.

    Lower-right causal: query i (position S - T + i) sees rows up to S - T + i.
    """
    # On CPU 16-bit storage stays 16-bit here: converting all S rows up front
    # made inductor write an fp32 copy of the whole history (twice for K: the
    # step's own rows were sliced from a second one) on every step.
    q, keys, values = _storage_views(q, k_store, v_store,
                                     convert=q.device.type == "cuda" or not _cpu_reads_16bit())
    # 16-bit attention: CUDA only (attention_dtype); flash needs one head dim for k and v.
    if q.dtype != torch.float32 and values.shape[-1] == keys.shape[-1]:
        return torch.ops.offgraph_kv.attend_causal(q, keys, values, scale).to(out_dtype)
    _, hq, t, _ = q.shape
    s, hkv = keys.shape[2], keys.shape[1]
    folded = _fold_groups(q, hkv)  # row r = g * T + i
    if q.device.type == "cpu" and _cpu_decode_lowering() == "rows":
        # The whole step, any width, in our kernel: the rows read as stored, the causal
        # band by row arithmetic; its output is dense, so the unfold is a view.
        out = torch.ops.offgraph_kv.rows_attend_causal(folded, keys, values, scale, hq // hkv)
        return out.view(1, hq, t, out.shape[-1]).to(out_dtype)
    seen = s - t + 1  # rows every query sees: the history and the step's first row (never empty)
    k_a, v_a = keys.narrow(2, 0, seen), values.narrow(2, 0, seen)
    if q.device.type == "cpu" and keys.dtype != torch.float32:  # 16-bit, as stored
        out_a, lse_a = _history_16bit(t, folded, k_a, v_a, scale, hq // hkv)
    else:
        out_a, lse_a = torch.ops.offgraph_kv.attend_with_lse(folded, k_a, v_a, scale)
    # The step's remaining T - 1 rows: query i sees row seen + j only when j < i.
    k_b = keys.narrow(2, seen, t - 1).float()
    v_b = values.narrow(2, seen, t - 1).float()
    logits = torch.matmul(folded.float(), k_b.transpose(-1, -2)) * scale  # [1, H_kv, G*T, T-1]
    i = torch.arange(t, device=q.device).repeat(hq // hkv)
    j = torch.arange(t - 1, device=q.device)
    logits = logits.masked_fill(j.unsqueeze(0) >= i.unsqueeze(1), float("-inf"))
    # lse_a is finite (row seen - 1 is visible to every query), so lse is too.
    lse = torch.logaddexp(lse_a, torch.logsumexp(logits, dim=-1))
    out = (out_a.float() * torch.exp(lse_a - lse).unsqueeze(-1)
           + torch.matmul(torch.exp(logits - lse.unsqueeze(-1)), v_b))
    return _unfold_groups(out, hq, t).to(out_dtype)
