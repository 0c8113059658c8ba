"""The GEMM a wider step calls: ATen's ``mm`` in the activations' dtype where the CPU has that
dtype's own instructions, else in fp32.

Without them ATen's bf16 / fp16 ``mm`` takes a slow path: on an AVX2-only AMD EPYC (no AVX-512
bf16, ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` False), 64 x 576 x 1536 in bf16 ran at
9.3 GFLOP/s against 58 for the same operands upcast to fp32, multiplied by MKL's sgemm and rounded
back, which is also what a bf16 GEMM computes (exact products, fp32 sums, one rounding). Like
every other kernel choice, the exporting machine's ISA is the program's.
"""

from __future__ import annotations

import torch


def native_gemm(dtype: torch.dtype) -> bool:
    """Whether ATen's CPU GEMM in ``dtype`` runs on the exporting machine's own instructions (oneDNN's
    check for bf16 and fp16; every other dtype is taken as native)."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for ``x [R, K]``, ``w [N, K]`` of one dtype: in fp32 on a CPU without that dtype's
    native GEMM (the result rounded back to ``x``'s dtype), else ``torch.mm``."""
    if x.device.type != "cpu" or native_gemm(x.dtype):
        return torch.mm(x, w.t())
    return torch.mm(x.float(), w.float().t()).to(x.dtype)
