"""CPU decode linears: a one-row step reads each weight once, as stored.

A decode step is about 80 % one-row matrix products over the weights
(``benchmarks/results/cpu_profile_smollm2_bf16.md``), and ATen's GEMM for one
row (MKL's sgemm, oneDNN's bf16 GEMM) streams the weight matrix at a third to
a half of what one core reads here; inductor's own reduction kernel over the
same weight reads it about twice as fast for one row, but is 3-13x slower for
64 (``benchmarks/results/cpu_gemv.md``). One program serves both widths, so
each linear becomes a branch on the step width (``torch.cond``, compiled into
the code): one row -> our kernel (``native/decode_linear.cpp``: each weight
row streamed once as stored, fp32 accumulation; it shares the rows among the
delegate's helper threads), or with ``OFFGRAPH_KV_CPU_GEMV=reduce`` inductor's
``sum(x * w)``; wider -> ATen's ``mm`` (on a CPU without a native 16-bit GEMM
in fp32, a block of weight rows at a time: ``gemm.py``), or for bf16 on a machine with the
AVX-512 bf16 dot product our kernel's GEMM (``wide_kernel_takes``), and where
both widths run the kernel there is no branch at all. Nothing is packed
or copied: the weight stays the constant the ``.pte`` stores.

A linear here is ``linear(x, W[, b])`` (the partitioner keeps ``nn.Linear``
whole), ``mm(x, permute(W, [1, 0]))`` or ``addmm(b, x, permute(W, [1, 0]))``,
with ``W`` a constant of the program; a product of two activations, a weight
computed in the graph (a dequantised int4 weight) or a static width of more
than one row is left alone; a linear that always takes one row (the output
projection of a model that returns the last token's logits) takes the
one-row form outright.
``OFFGRAPH_KV_CPU_GEMV=mm`` (read at export) keeps every linear on ATen's GEMM.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import fx

import offgraph_kv.backend.cpu_kernels  # noqa: F401  (registers offgraph_kv::linear_rows)
from offgraph_kv.backend.gemm import gemm, native_gemm
from offgraph_kv.backend.switches import switch
from offgraph_kv.backend.width_branch import by_width

ENV_SWITCH = "OFFGRAPH_KV_CPU_GEMV"
MODES = ("auto", "reduce", "mm")


def one_row_mode() -> str:
    """How CPU exports run one-row linears (``OFFGRAPH_KV_CPU_GEMV``): "auto" (the default: our kernel
    for every one-row linear whose dtypes it reads, float, int8 and int4), "reduce" (inductor's
    reduction for all) or "mm" (ATen's GEMM, no branch on the width).

    Why the kernel everywhere: whole bf16 SmolLM2 steps with every linear on it took 0.86x / 0.82x the
    reductions' time at 200 / 2,000 tokens on an AMD EPYC (Zen 4, ``benchmarks/results/
    cpu_decode_linear_ab_bf16.md``); on an Intel Xeon (Sapphire Rapids) the two were equal with one
    thread and the kernel 1.25-1.5x faster with two, since its helpers share the rows
    (``cpu_decode_kernel_every_row_intel.md``). The vocabulary projection was the kernel's on both
    from the start (the reduction read 576 -> 49,152 at 0.6x its speed, ``cpu_gemv_kernel.md``)."""
    return switch(ENV_SWITCH, MODES, "auto")


def _cpuinfo(key: str) -> str:
    """The exporting machine's first ``key`` line in /proc/cpuinfo, its value ("" if none or unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_has_bf16_dots() -> bool:
    """Whether the exporting machine has the AVX-512 bf16 dot product (``avx512_bf16`` in /proc/cpuinfo)."""
    return "avx512_bf16" in _cpuinfo("flags").split()


def wide_kernel_takes(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether a wider step (two rows or more) runs our kernel's GEMM (``native/wide_rows.h``: the AVX-512
    bf16 dot product over weights read as bf16 rows) instead of ATen's: mode "auto", bf16
    activations, dense weights as stored, on a machine with the instruction (the exporting machine's ISA
    is the program's). Which weight dtypes the kernel reads is the caller's to add. Measured on an AMD EPYC
    (Zen 4), 64 rows: 178-198 GFLOP/s against oneDNN's 187 for bf16 weights; SmolLM2 weight-only int8
    prefill (512 tokens) 2.0x ATen's int8 GEMM's speed, with no dequantized weight, primitive cache or oneDNN code in
    the process (``benchmarks/results/cpu_wide_rows_ab_int8.md``)."""
    return (one_row_mode() == "auto" and x.dtype == torch.bfloat16 and cpu_has_bf16_dots()
            and all(w.is_contiguous() for w in weights))


def reduction_applies() -> bool:
    """Whether CPU exports branch their linears on the step width (every mode but "mm")."""
    return one_row_mode() != "mm"


KERNEL_FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # what native/decode_linear.cpp reads


def kernel_takes(x: torch.Tensor, *weights: torch.Tensor, floats: int = 2) -> bool:
    """Whether a one-row linear runs our kernel: the export's mode is "auto", every weight is a dense
    row-major tensor as stored, and ``x`` and the first ``floats`` operands are fp32, bf16 or fp16 (any
    other dtype, fp64 say, keeps the reduction)."""
    dense = all(w.is_contiguous() for w in weights)
    typed = all(t.dtype in KERNEL_FLOATS for t in (x, *weights)[:floats])
    return one_row_mode() == "auto" and dense and typed


def _reduction(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # [1, K] x [N, K] -> [1, N]; the products and the sum in fp32 (as a GEMM accumulates).
    return (x.float().unsqueeze(1) * w.float().unsqueeze(0)).sum(-1).to(x.dtype)


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if native_gemm(x.dtype):
        return torch.mm(x, w.t())
    # Upcast to fp32 (gemm.py) a cache-sized block of weight rows at a time: the whole output
    # projection in fp32 would be a 108 MiB transient for SmolLM2.
    from offgraph_kv.backend.quantized_linear import block_rows, in_row_blocks
    return in_row_blocks(gemm, x, block_rows(x.shape[-1], torch.float32), w)


def _one_row_form(x: torch.Tensor, w: torch.Tensor) -> Callable[..., torch.Tensor]:
    if kernel_takes(x, w):
        return torch.ops.offgraph_kv.linear_rows
    return _reduction


def _many_rows_form(x: torch.Tensor, w: torch.Tensor) -> Callable[..., torch.Tensor]:
    if w.dtype == torch.bfloat16 and wide_kernel_takes(x, w):
        return torch.ops.offgraph_kv.linear_rows
    return _mm


def linear_by_width(x: torch.Tensor, w: torch.Tensor, bias: "torch.Tensor | None" = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for ``x [..., K]``, ``w [N, K]``: a reduction or our kernel when ``x``
    holds one row, ATen's GEMM or our kernel otherwise (one call, no branch, where the kernel takes
    both)."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    out = by_width(rows.shape[0], _one_row_form(rows, w), _many_rows_form(rows, w), (rows, w))
    out = out.reshape(*lead, w.shape[0])
    return out if bias is None else out + bias


def _addmm_by_width(bias: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return linear_by_width(x, w, bias)


def _transposed_constant(node: object) -> "fx.Node | None":
    """``W`` when ``node`` is ``permute(W, [1, 0])`` (or ``W.t()``) of a constant of the program."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is torch.ops.aten.permute.default and list(node.args[1]) == [1, 0]:
        src = node.args[0]
    elif node.target is torch.ops.aten.t.default:
        src = node.args[0]
    else:
        return None
    return src if isinstance(src, fx.Node) and src.op == "get_attr" else None


def _step_rows(x: object) -> bool:
    """An activation whose row count (all but the last dim) is the step's (symbolic),
    or one row always (a model that projects only the last token to logits)."""
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return False
    lead = val.shape[:-1]
    if any(isinstance(d, torch.SymInt) for d in lead):
        return True
    return math.prod(int(d) for d in lead) == 1


def _constant(node: object) -> "fx.Node | None":
    return node if isinstance(node, fx.Node) and node.op == "get_attr" else None


def use_reductions_for_one_row(program: fx.GraphModule) -> int:
    """Rewrite the program's linears (in place) to branch on the width; returns how many."""
    count = 0
    for node in list(program.graph.nodes):
        if node.op != "call_function":
            continue
        wt = None
        if node.target is torch.ops.aten.linear.default and not node.kwargs:
            x, w = node.args[0], _constant(node.args[1])
            args = (x, w, *node.args[2:])
        elif node.target is torch.ops.aten.mm.default:
            x, wt = node.args
            w = _transposed_constant(wt)
            args = (x, w)
        elif node.target is torch.ops.aten.addmm.default and len(node.args) == 3 and not node.kwargs:
            bias, x, wt = node.args
            w = _transposed_constant(wt)
            args = (bias, x, w)
        else:
            continue
        if w is None or not _step_rows(x):
            continue
        with program.graph.inserting_before(node):
            fn = _addmm_by_width if node.target is torch.ops.aten.addmm.default else linear_by_width
            new = program.graph.call_function(fn, args)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        program.graph.erase_node(node)
        if wt is not None and not wt.users:  # the transpose was the linear's own
            program.graph.erase_node(wt)
        count += 1
    program.recompile()
    return count
