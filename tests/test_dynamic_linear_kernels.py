"""The int8-dynamic-activation kernels, int4 and int8 weights
(``native/dynamic_linear.cpp``), compiled into an AOTInductor program the way
every CPU program gets them, against the same integer arithmetic written in
torch (``int4_da8_integer_rows``, ``int8_da8_integer_rows``), and that
arithmetic against torchao's own quantization primitives: per-token activation
quantization equal to torchao's, outputs off the 16-output tile, int4 groups of
8 and 32 inputs, 1 to 70 rows (several token batches and a remainder), strided
activations, fp32 / bf16 / fp16 activations and scales, one and two threads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
from torch.export import Dim

from compiled_calls import check_shared_with_helpers, run_with_threads

from offgraph_kv.backend.aoti_compile import compile_shared_object
from offgraph_kv.backend.quantized_linear import (int4_da8_integer_rows, int4_da8_torchao_form,
                                                  int8_da8_integer_rows, int8_da8_torchao_form, pack_int4_tiles,
                                                  pack_int8_tiles, quantize_per_token, unpack_int4_tiles,
                                                  unpack_int8_tiles, untile_scale)

# (activation dtype, scale dtype) of the calls
CALLS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)]


class _Calls(torch.nn.Module):
    """Each kernel once per dtype pair; the activations arrive transposed ([K, R]), a strided view."""

    def forward(self, xt: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, rowsum: torch.Tensor,
                packed8: torch.Tensor, scale8: torch.Tensor, wsum: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        x, ops = xt.t(), torch.ops.offgraph_kv
        return (*(ops.int4_da8_linear_rows(x.to(xd), packed, scale.to(sd), rowsum) for xd, sd in CALLS),
                *(ops.int8_da8_linear_rows(x.to(xd), packed8, scale8.to(sd), wsum) for xd, sd in CALLS))


def _weights(n: int, k: int, group: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, k // group, generator=g) * 0.05 + 1e-3
    return q, s


def _weights8(n: int, k: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 2)
    return torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g) * 1e-2 + 1e-4


def _inputs(rows: int, k: int, n: int, group: int, seed: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(k, rows, generator=g) * 3 + 0.5  # asymmetric: a nonzero zero point
    return [x, *pack_int4_tiles(*_weights(n, k, group, seed), group), *pack_int8_tiles(*_weights8(n, k, seed))]


_LIBRARIES: Dict[int, Path] = {}  # group -> the compiled calls' shared object (the runner's own library)


@pytest.fixture(scope="module", params=[32, 8], ids=["group32", "group8"])
def compiled(request, tmp_path_factory) -> "Tuple[torch._C._aoti.AOTIModelContainerRunnerCpu, int]":
    group = request.param
    args = _inputs(3, 4 * group, 20, group, 0)
    r, b, n = Dim("rows", min=1, max=512), Dim("blocks", min=1, max=8192), Dim("n", min=1, max=1 << 17)
    kg = Dim("kgroups", min=1, max=1024)
    shapes = ({0: group * kg, 1: r}, {0: b, 1: (group // 8) * kg}, {0: b, 1: kg}, {0: n},
              {0: b, 1: (group // 4) * kg}, {0: n}, {0: n})
    program = torch.export.export(_Calls(), tuple(args), dynamic_shapes=shapes)
    code = compile_shared_object(program, args, "cpu")
    path = tmp_path_factory.mktemp("dynamic_linear") / "calls.so"
    path.write_bytes(code.so_bytes)
    _LIBRARIES[group] = path
    return torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1), group


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,kgroups,n", [(1, 1, 1), (1, 3, 7), (1, 18, 576), (3, 5, 13), (5, 2, 1031),
                                            (70, 4, 33), (2, 9, 4097)])
def test_dynamic_kernels_in_a_compiled_program_match_their_integer_arithmetic(compiled, rows, kgroups, n, threads):
    runner, group = compiled
    args = _inputs(rows, kgroups * group, n, group, seed=n * 7 + kgroups)
    got = run_with_threads(runner, args, threads)
    xt, packed, scale, rowsum, packed8, scale8, wsum = args
    wants = [int4_da8_integer_rows(xt.t().to(xd), packed, scale.to(sd), rowsum) for xd, sd in CALLS]
    wants += [int8_da8_integer_rows(xt.t().to(xd), packed8, scale8.to(sd), wsum) for xd, sd in CALLS]
    for i, want in enumerate(wants):
        xd = want.dtype
        assert got[i].dtype == xd and got[i].shape == (rows, n), i
        # The same integers; fp32 sums in another order, then one rounding to x's dtype.
        atol, rtol = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 1.6e-2), torch.float16: (4e-3, 2e-3)}[xd]
        torch.testing.assert_close(got[i].float(), want.float(), atol=atol, rtol=rtol, msg=lambda m: f"call {i}: {m}")


@pytest.mark.parametrize("stalled", [False, True], ids=["running", "stalled"])
def test_dynamic_kernels_shared_with_helpers_give_the_one_thread_bits(compiled, stalled):
    """Decode steps with a helper thread (shared_rows.h): one thread's bits, the helper running or stalled.
    Output counts from 16 tiles (256), off the 64-output chunk and the 16-output tile; one to five rows."""
    runner, group = compiled
    cases = [_inputs(rows, kg * group, n, group, seed=n + rows) for rows, kg, n in
             [(1, 18, 576), (1, 2, 1031), (2, 9, 4097), (5, 3, 300), (1, 18, 65536)]]
    check_shared_with_helpers(runner, _LIBRARIES[group], cases, stalled)


@pytest.mark.parametrize("which", ["int4", "int8"])
def test_dynamic_kernels_reject_tiles_that_disagree_with_the_row_sums(compiled, which):
    runner, group = compiled
    args = _inputs(1, 2 * group, 40, group, seed=3)  # 3 tiles of rows
    cut = 3 if which == "int4" else 6
    args[cut] = args[cut][:16]  # 16 outputs fill only one of the three tiles
    with pytest.raises(RuntimeError):
        runner.run(args)


def test_int4_tiles_round_trip_and_pad_the_last_tile_with_zero_rows():
    q, s = _weights(37, 64, 32, seed=5)
    packed, scale, rowsum = pack_int4_tiles(q, s, 32)
    assert packed.shape == (3, 8, 64) and scale.shape == (3, 2, 16) and rowsum.shape == (37,)
    assert torch.equal(unpack_int4_tiles(packed, 37), q)
    assert torch.equal(unpack_int4_tiles(packed, 48)[37:], torch.zeros(11, 64, dtype=torch.int8))
    assert torch.equal(untile_scale(scale, 37), s)
    w = q.double() * s.double().repeat_interleave(32, dim=1)
    torch.testing.assert_close(rowsum, w.sum(1).float())
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4_tiles(q, s, 12)
    with pytest.raises(ValueError, match="outside"):
        pack_int4_tiles(q * 2, s, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_per_token_quantization_is_torchaos(dtype):
    from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine

    g = torch.Generator().manual_seed(11)
    x = (torch.randn(9, 96, generator=g) * torch.linspace(0.01, 40, 9).unsqueeze(-1) + 1.5).to(dtype)
    x[3] = 0  # a zero row: the scale's lower bound
    x[4] = x[4].abs()  # no negative value: a zero point at the bottom
    xq, sx, zero = quantize_per_token(x)
    scale, zp = choose_qparams_affine(x, MappingType.ASYMMETRIC, (1, 96), torch.int8, -128, 127,
                                      zero_point_dtype=torch.int8)
    want = quantize_affine(x, (1, 96), scale, zp, torch.int8, -128, 127)
    assert torch.equal(sx, scale) and torch.equal(zero, zp.to(torch.int32)) and torch.equal(xq, want)


def test_int8_tiles_round_trip_with_row_sums():
    q, s = _weights8(37, 64, seed=5)
    packed, scale, wsum = pack_int8_tiles(q, s)
    assert packed.shape == (3, 16, 64) and packed.dtype == torch.int8 and wsum.dtype == torch.int32
    assert torch.equal(unpack_int8_tiles(packed, 37), q) and torch.equal(wsum, q.int().sum(1, dtype=torch.int32))
    assert torch.equal(unpack_int8_tiles(packed, 48)[37:], torch.zeros(11, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match="multiples of 4"):
        pack_int8_tiles(q[:, :62], s)


def test_integer_arithmetic_is_torchaos_linear_within_rounding():
    q, s = _weights(50, 96, 32, seed=2)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(4)) * 2 - 0.3
    tiles = pack_int4_tiles(q, s, 32)
    exact = int4_da8_integer_rows(x, *tiles)
    torch.testing.assert_close(int4_da8_torchao_form(x, *tiles), exact, atol=1e-5, rtol=1e-5)
    tiles8 = pack_int8_tiles(*_weights8(50, 96, seed=2))
    exact8 = int8_da8_integer_rows(x, *tiles8)
    torch.testing.assert_close(int8_da8_torchao_form(x, *tiles8), exact8, atol=1e-5, rtol=1e-5)
