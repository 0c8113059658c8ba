"""CPU attention over 16-bit KV storage reads the stored rows as they are.

The compiled step's lowering (``backend/attention.py``), run eagerly: decode
steps attend bf16/fp16 storage through fp32 reductions over the 16-bit rows
(no fp32 copy of the history), wider steps convert only the rows they see.
Either way the arithmetic is fp32 over the stored values, so it must agree
with fp32 attention over the same (widened) rows to fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from offgraph_kv.backend import attention
from offgraph_kv.backend.private_tensors import write_and_attend_flat

H_Q, H_KV, D = 6, 2, 16


def _reference(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 causal attention (lower-right: the last T rows are the step's) over the widened storage."""
    t, s = q.shape[2], k_store.shape[1]
    k = k_store.transpose(1, 2).float().repeat_interleave(H_Q // H_KV, dim=1)
    v = v_store.transpose(1, 2).float().repeat_interleave(H_Q // H_KV, dim=1)
    mask = torch.ones(t, s, dtype=torch.bool).tril(diagonal=s - t)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("lowering", ["direct", "grouped"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("history,width", [(0, 1), (1, 1), (37, 1), (300, 1), (0, 5), (40, 7), (300, 16)])
def test_16bit_storage_attention_matches_fp32_attention_over_the_stored_rows(dtype, history, width, lowering,
                                                                             monkeypatch):
    monkeypatch.setenv(attention.CPU_ENV_SWITCH, lowering)
    g = torch.Generator().manual_seed(history * 31 + width)
    s = history + width
    q = torch.randn(1, H_Q, width, D, generator=g)
    k = torch.randn(1, H_KV, width, D, generator=g)
    v = torch.randn(1, H_KV, width, D, generator=g)
    k_store = torch.randn(1, s, H_KV, D, generator=g).to(dtype)
    v_store = torch.randn(1, s, H_KV, D, generator=g).to(dtype)
    got = write_and_attend_flat(q, k, v, k_store, v_store, 0.25, torch.float32)
    # The write rounds the step's own K/V to the storage dtype, as the oracle's cache does.
    want = _reference(q, k_store, v_store, 0.25)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)


def test_reduced_attention_returns_fp32_output_and_log_sum_exp():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, H_KV, 3, D, generator=g)
    k = torch.randn(1, H_KV, 50, D, generator=g).bfloat16()
    v = torch.randn(1, H_KV, 50, 24, generator=g).bfloat16()  # a value head dim of its own
    out, lse = attention.reduced_attention_with_lse(q, k, v, 0.3)
    logits = q @ k.float().transpose(-1, -2) * 0.3
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, torch.softmax(logits, -1) @ v.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("groups", [1, 3, 4])
def test_grouped_decode_attention_equals_the_row_batched_reductions(groups):
    # The one-token form (each KV head's query rows written out one by one) computes
    # the same fp32 sums as the row-batched form: only inductor's loop nest differs.
    g = torch.Generator().manual_seed(groups)
    q = torch.randn(1, H_KV, groups, D, generator=g)
    k = torch.randn(1, H_KV, 70, D, generator=g).bfloat16()
    v = torch.randn(1, H_KV, 70, D, generator=g).bfloat16()
    want = attention.reduced_attention_with_lse(q, k, v, 0.3)
    got = attention.grouped_decode_attention_with_lse(q, k, v, 0.3, groups)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_cpu_attention_switch_rejects_an_unknown_lowering(monkeypatch):
    monkeypatch.setenv(attention.CPU_ENV_SWITCH, "fast")
    with pytest.raises(ValueError, match="OFFGRAPH_KV_CPU_ATTENTION.*'fast'"):
        attention.attend_flat(torch.zeros(1, H_Q, 1, D), torch.zeros(1, 1, H_KV, D, dtype=torch.bfloat16),
                              torch.zeros(1, 1, H_KV, D, dtype=torch.bfloat16), 0.25, torch.float32)
