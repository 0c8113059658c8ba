"""The wider steps' GEMM (``backend/gemm.py``): in fp32 where the CPU lacks the 16-bit dtype's native
GEMM, the same result as a 16-bit GEMM, whole or a block of weight rows at a time."""

from __future__ import annotations

import pytest
import torch

from offgraph_kv.backend import decode_gemv, gemm, quantized_linear


@pytest.fixture(params=[False, True], ids=["upcast", "native"])
def native(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(gemm, "native_gemm", lambda dtype, native=request.param: native or dtype == torch.float32)
    monkeypatch.setattr(decode_gemv, "native_gemm", gemm.native_gemm)
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemm_without_native_16bit_is_the_fp32_product_rounded_once(native: bool, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 96, generator=g).to(dtype)
    w = torch.randn(40, 96, generator=g).to(dtype)
    out = gemm.gemm(x, w)
    assert out.dtype == dtype and out.shape == (24, 40)
    exact = torch.mm(x.double(), w.double().t())
    if not native:
        assert torch.equal(out, torch.mm(x.float(), w.float().t()).to(dtype))
    # Either way within one rounding of the exact product (fp32 sums over 96 terms).
    tol = (exact.abs() * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10) + 1e-3)
    assert ((out.double() - exact).abs() <= tol).all()


def test_dense_wide_step_in_weight_row_blocks_equals_the_whole_weight(native: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Blocks of 64 rows over a 200-row weight (a partial last block): the concatenation must be the
    # whole product, column for column.
    monkeypatch.setattr(quantized_linear, "block_rows", lambda k, dtype: 64)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 128, generator=g).bfloat16()
    w = torch.randn(200, 128, generator=g).bfloat16()
    out = decode_gemv._mm(x, w)
    assert out.shape == (16, 200)
    whole = torch.mm(x.float(), w.float().t())
    assert torch.allclose(out.float(), whole, rtol=2 ** -7, atol=1e-2)
    if not native:
        assert torch.equal(out, torch.cat([gemm.gemm(x, w[n:n + 64]) for n in range(0, 200, 64)], dim=-1))


def test_quantized_wide_steps_keep_torchaos_bf16_weight_rounding_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    # Upcasting must not skip the weight's rounding to bf16 that torchao's dequantize does.
    monkeypatch.setattr(gemm, "native_gemm", lambda dtype: dtype == torch.float32)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 64, generator=g).bfloat16()
    q = torch.randint(-127, 128, (48, 64), generator=g, dtype=torch.int8)
    s = (torch.rand(48, generator=g) / 50 + 1e-3).bfloat16()
    out = quantized_linear.int8_many_rows(x, q, s, block=16)
    wq = (q.float() * s.float().unsqueeze(-1)).bfloat16().float()
    assert torch.equal(out, torch.mm(x.float(), wq.t()).bfloat16())
