"""Our CPU decode-linear kernels, compiled into an AOTInductor program the way
every CPU program gets them (``backend/cpu_kernels.py``), against their eager
forms (the fp32 sums the one-row reductions compute): fp32 / bf16 / fp16
activations and weights, int8 rows with a scale each, int4 groups with and
without zero points, input widths off the vector length, output counts off the
four-output block and on both sides of a thread's share, several rows, strided
activations. bf16 rows take paths of their own (int4 groups of 32: the bf16 dot
product, where the CPU has it; int8 rows: int16 blocks, on AVX-512 BW and AVX2;
int4 groups of 32 and 64: int16 blocks, on AVX2), each
checked beside the fp32 path (``OFFGRAPH_KV_CPU_BF16_ROWS=fp32``) on group
counts off its four-group pass and widths off its 64-input block; rows with a
wide range of magnitudes and rows that are not finite.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
from torch.export import Dim

from compiled_calls import check_shared_with_helpers, run_with_threads

from offgraph_kv.backend.aoti_compile import compile_shared_object
from offgraph_kv.backend.cpu_kernels import (_int4_rows_reference, _int4z_rows_reference,
                                             _int8_rows_reference, _linear_rows_reference)
from offgraph_kv.backend.quantized_linear import pack_int4

# (activation dtype, weight dtype) of the dense calls
DENSE = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
         (torch.float32, torch.bfloat16)]


class _Calls(torch.nn.Module):
    """Every kernel once per case; the activations arrive transposed ([K, R]) so the
    kernels also read a strided view, as a fused producer may hand them one."""

    def forward(self, xt: torch.Tensor, w32: torch.Tensor, wbf: torch.Tensor, w16: torch.Tensor,
                q8: torch.Tensor, s8: torch.Tensor, p4: torch.Tensor, s4: torch.Tensor,
                z4: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ops = torch.ops.offgraph_kv
        x = xt.t()
        ws = {torch.float32: w32, torch.bfloat16: wbf, torch.float16: w16}
        outs = [ops.linear_rows(x.to(xd), ws[wd]) for xd, wd in DENSE]
        outs.append(ops.int8_linear_rows(x, q8, s8))
        outs.append(ops.int8_linear_rows(x.bfloat16(), q8, s8.bfloat16()))
        outs.append(ops.int4_linear_rows(x, p4, s4))
        outs.append(ops.int4z_linear_rows(x.bfloat16(), p4, s4.bfloat16(), z4))
        # bf16 rows: the bf16 dot-product path for groups of 32, with each scale dtype
        outs.append(ops.int4_linear_rows(x.bfloat16(), p4, s4.bfloat16()))
        outs.append(ops.int4_linear_rows(x.bfloat16(), p4, s4))
        outs.append(ops.int4_linear_rows(x.bfloat16(), p4, s4.half()))
        outs.append(ops.int4z_linear_rows(x.bfloat16(), p4, s4, z4))
        return tuple(outs)


def _inputs(rows: int, k: int, n: int, group: int, seed: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(k, rows, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    q8 = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    s8 = torch.rand(n, generator=g) * 0.02 + 1e-3
    q4 = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    s4 = torch.rand(n, k // group, generator=g) * 0.1 + 1e-3
    z4 = torch.randint(-3, 4, (n, k // group), generator=g, dtype=torch.int8)
    return [x, w, w.bfloat16(), w.half(), q8, s8, pack_int4(q4, group), s4, z4]


def _expected(args: List[torch.Tensor]) -> List[torch.Tensor]:
    xt, w32, wbf, w16, q8, s8, p4, s4, z4 = args
    x = xt.t()
    ws = {torch.float32: w32, torch.bfloat16: wbf, torch.float16: w16}
    want = [_linear_rows_reference(x.to(xd), ws[wd]) for xd, wd in DENSE]
    want.append(_int8_rows_reference(x, q8, s8))
    want.append(_int8_rows_reference(x.bfloat16(), q8, s8.bfloat16()))
    want.append(_int4_rows_reference(x, p4, s4))
    want.append(_int4z_rows_reference(x.bfloat16(), p4, s4.bfloat16(), z4))
    want.append(_int4_rows_reference(x.bfloat16(), p4, s4.bfloat16()))
    want.append(_int4_rows_reference(x.bfloat16(), p4, s4))
    want.append(_int4_rows_reference(x.bfloat16(), p4, s4.half()))
    want.append(_int4z_rows_reference(x.bfloat16(), p4, s4, z4))
    return want


_LIBRARIES: Dict[int, Path] = {}  # group -> the compiled calls' shared object (the runner's own library)


@pytest.fixture(scope="module", params=[32, 8, 64], ids=["group32", "group8", "group64"])
def compiled(request, tmp_path_factory) -> "Tuple[torch._C._aoti.AOTIModelContainerRunnerCpu, int]":
    # 32: each half-group whole vectors; 8: shorter than a vector (the scalar form); 64: a group a
    # whole int16 block (AVX2's integer path)
    group = request.param
    args = _inputs(2, 4 * group, 12, group, 0)
    r, n = Dim("rows", min=1, max=64), Dim("n", min=1, max=1 << 20)
    kg = Dim("kgroups", min=1, max=4096)
    k = group * kg
    shapes = ({0: k, 1: r}, {0: n, 1: k}, {0: n, 1: k}, {0: n, 1: k}, {0: n, 1: k}, {0: n},
              {0: n, 1: kg}, {0: n, 1: kg}, {0: n, 1: kg})
    program = torch.export.export(_Calls(), tuple(args), dynamic_shapes=shapes)
    code = compile_shared_object(program, args, "cpu")
    path = tmp_path_factory.mktemp("offgraph_kv_linear") / "calls.so"
    path.write_bytes(code.so_bytes)
    _LIBRARIES[group] = path
    return torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1), group


def _tolerance(dtype: torch.dtype) -> Tuple[float, float]:
    # One rounding of an fp32 sum to the output dtype, plus the sums' order (fp32: up to 1,536 terms of
    # either sign summed in another order than the reference's, a few ulps of the terms' magnitude).
    return {torch.float32: (3e-5, 3e-5), torch.bfloat16: (1e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}[dtype]


@pytest.mark.parametrize("bf16_rows", ["own", "fp32"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,kgroups,n", [(1, 1, 1), (1, 3, 7), (1, 18, 576), (3, 5, 13), (1, 2, 1031),
                                            (2, 9, 4097), (4, 8, 6)])
def test_linear_kernels_in_a_compiled_program_match_their_fp32_sums(compiled, rows, kgroups, n, threads, bf16_rows,
                                                                    monkeypatch):
    runner, group = compiled
    monkeypatch.setenv("OFFGRAPH_KV_CPU_BF16_ROWS", bf16_rows)  # read by the kernels at each call
    args = _inputs(rows, kgroups * group, n, group, seed=n * 7 + kgroups)
    got = run_with_threads(runner, args, threads)  # outputs split over the threads (2: from 1,024 outputs)
    for i, want in enumerate(_expected(args)):
        assert got[i].dtype == want.dtype and got[i].shape == (rows, n), i
        atol, rtol = _tolerance(want.dtype)
        torch.testing.assert_close(got[i].float(), want.float(), atol=atol, rtol=rtol, msg=lambda m: f"call {i}: {m}")



@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,kgroups,n", [(4, 1, 13), (16, 5, 37), (17, 18, 100), (33, 3, 8), (64, 18, 576)])
def test_wide_bf16_steps_give_torchaos_dequantize_then_mm(compiled, rows, kgroups, n, threads):
    """Steps of several bf16 rows: the GEMM on the bf16 dot product where the CPU has it (native/wide_rows.h;
    bf16 weights from 4 rows, int8 / int4 from 16), else the per-row paths; either way what ATen's bf16 mm
    gives over the weights dequantized in fp32 and rounded to bf16 (torchao's form), within the two
    results' roundings. Row and output counts off the 16-row vector and the 8-output tile, both sides of a
    thread's share."""
    from offgraph_kv.backend import quantized_linear as ql

    runner, group = compiled
    args = _inputs(rows, kgroups * group, n, group, seed=rows * 31 + n)
    got = run_with_threads(runner, args, threads)
    xt, _, wbf, _, q8, s8, p4, s4, z4 = args
    x = xt.t().bfloat16()
    bf = torch.bfloat16
    want = {1: torch.mm(x, wbf.t()),
            len(DENSE) + 1: ql.int8_many_rows(x, q8, s8.to(bf)),
            len(DENSE) + 3: ql.int4_many_rows(x, p4, s4.to(bf), z4),
            len(DENSE) + 4: ql.int4_many_rows(x, p4, s4.to(bf), None),
            len(DENSE) + 5: ql.int4_many_rows(x, p4, s4, None),
            len(DENSE) + 6: ql.int4_many_rows(x, p4, s4.half(), None),
            len(DENSE) + 7: ql.int4_many_rows(x, p4, s4, z4)}
    for i, w in want.items():
        assert got[i].dtype == bf and got[i].shape == (rows, n), i
        # the same exact products summed in two orders in fp32, each rounded once to bf16: apart by at
        # most an ulp of bf16 (2^-7 of the row's largest) and the sums' order
        scale = w.float().abs().amax(dim=1, keepdim=True)
        err = ((got[i].float() - w.float()).abs() / scale).max().item()
        assert err <= 2 ** -6, (i, err)


def test_bf16_rows_of_a_wide_range_keep_the_fp32_paths_accuracy(compiled, monkeypatch):
    """Values 2^-12 .. 2^12 of each other in one row (int16 blocks round those far below a block's
    largest): the int8 and int4 results against the double-precision sums, as the fp32 path is."""
    runner, group = compiled
    args = _inputs(2, 12 * group, 37, group, seed=5)
    g = torch.Generator().manual_seed(6)
    args[0] = args[0] * torch.pow(2.0, torch.randint(-12, 13, args[0].shape, generator=g).float())
    xt, _, _, _, q8, s8, p4, s4, _ = args
    x = xt.t().bfloat16().double()
    exact8 = (x @ q8.double().t()) * s8.bfloat16().double()
    exact4 = x @ (_dequantized_int4(p4, s4.bfloat16().double())).t()
    for how in ("own", "fp32"):
        monkeypatch.setenv("OFFGRAPH_KV_CPU_BF16_ROWS", how)
        got = runner.run(args)
        for out, exact in ((got[len(DENSE) + 1], exact8), (got[len(DENSE) + 4], exact4)):
            # bf16 outputs: one rounding, relative to the row's scale of sums
            scale = exact.abs().amax(dim=1, keepdim=True)
            err = ((out.double() - exact).abs() / scale).max().item()
            assert err < 8e-3, (how, err)


def test_bf16_rows_that_are_not_finite_give_what_the_fp32_path_gives(compiled, monkeypatch):
    runner, group = compiled
    args = _inputs(3, 4 * group, 9, group, seed=7)
    args[0][5, 0] = float("inf")
    args[0][7, 1] = float("nan")
    results = {}
    for how in ("own", "fp32"):
        monkeypatch.setenv("OFFGRAPH_KV_CPU_BF16_ROWS", how)
        results[how] = runner.run(args)
    for i in (len(DENSE) + 1, len(DENSE) + 4):
        own, fp32 = results["own"][i].float(), results["fp32"][i].float()
        assert torch.equal(own.isnan(), fp32.isnan()) and torch.equal(own.isinf(), fp32.isinf()), i
        assert not own[:2].isfinite().any() and own[2].isfinite().all(), i  # rows 0, 1 carry Inf / NaN


def _dequantized_int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from offgraph_kv.backend.quantized_linear import unpack_int4

    q = unpack_int4(packed).double()
    return q * scale.repeat_interleave(q.shape[1] // scale.shape[1], dim=1)



# Cases with enough outputs to be shared (from 256): one to three rows, output counts off the 64-output
# chunk and the 4-output block.
_SHARED_CASES = [(1, 18, 576), (1, 2, 1031), (2, 9, 4097), (3, 5, 300), (1, 18, 65536)]


@pytest.mark.parametrize("stalled", [False, True], ids=["running", "stalled"])
def test_decode_linears_shared_with_helpers_give_the_one_thread_bits(compiled, stalled):
    """A decode step's linears with a helper thread (shared_rows.h) give exactly what one thread gives,
    whether the helper publishes its chunks or stalls holding them (then the caller takes them back)."""
    runner, group = compiled
    cases = [_inputs(rows, kg * group, n, group, seed=n + rows) for rows, kg, n in _SHARED_CASES]
    check_shared_with_helpers(runner, _LIBRARIES[group], cases, stalled)
