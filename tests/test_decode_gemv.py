"""Which one-row form each CPU linear gets (``backend/decode_gemv.py``): in the
default mode ("auto") every float linear runs our kernel, whatever its size
(int8 / int4 linears too, ``tests/test_quantized_export.py``); "reduce" puts
every linear on inductor's reduction; and whichever form, one row and many
rows give the linear's result."""

from __future__ import annotations

from typing import List

import pytest
import torch

from offgraph_kv.backend import decode_gemv

VOCAB = 32000  # Llama-2's vocabulary: the smallest projection of a real model's size


class _Head(torch.nn.Module):
    """A decoder-sized linear (bias, so addmm) then a vocabulary-sized one."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.up = torch.nn.Linear(48, 40)
        self.out = torch.nn.Linear(40, VOCAB, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.up(x)))


def _kernel_calls_per_branch(monkeypatch: pytest.MonkeyPatch, mode: str) -> "tuple[List[int], torch.nn.Module]":
    monkeypatch.setenv(decode_gemv.ENV_SWITCH, mode)
    width = torch.export.Dim("t", max=64)
    model = _Head()
    program = torch.export.export(model, (torch.randn(3, 48),), dynamic_shapes=({0: width},)).module()
    assert decode_gemv.use_reductions_for_one_row(program) == 2
    lowered = torch.export.export(program, (torch.randn(3, 48),), dynamic_shapes=({0: width},), strict=False)
    calls = []
    for node in lowered.graph.nodes:
        if node.target is torch.ops.higher_order.cond:
            one_row = getattr(lowered.graph_module, node.args[1].target)  # the branch taken at width 1
            calls.append(sum(n.target is torch.ops.offgraph_kv.linear_rows.default for n in one_row.graph.nodes))
    return calls, lowered.module()


@pytest.mark.parametrize("mode,want", [("auto", [1, 1]), ("reduce", [0, 0])])
def test_one_row_linears_take_the_kernel_by_mode_whatever_their_size(monkeypatch: pytest.MonkeyPatch, mode: str,
                                                                     want: List[int]) -> None:
    """"auto": the kernel for a decoder-sized and a vocabulary-sized projection alike; "reduce": neither."""
    calls, _ = _kernel_calls_per_branch(monkeypatch, mode)
    assert calls == want  # [decoder-sized, vocabulary-sized]



def test_auto_mode_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(decode_gemv.ENV_SWITCH, raising=False)
    assert decode_gemv.one_row_mode() == "auto"


def test_kernel_is_not_taken_for_dtypes_or_layouts_it_does_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(decode_gemv.ENV_SWITCH, "auto")
    w = torch.zeros(16, 8)
    assert decode_gemv.kernel_takes(torch.zeros(1, 8), w)
    assert not decode_gemv.kernel_takes(torch.zeros(1, 8, dtype=torch.float64), w.double())
    assert not decode_gemv.kernel_takes(torch.zeros(1, 8), w.t().contiguous().t())
    monkeypatch.setenv(decode_gemv.ENV_SWITCH, "reduce")
    assert not decode_gemv.kernel_takes(torch.zeros(1, 8), w)


@pytest.mark.parametrize("mode", ["auto", "reduce"])
def test_lowered_linears_give_the_models_result_for_one_row_and_many(monkeypatch: pytest.MonkeyPatch,
                                                                       mode: str) -> None:
    _, lowered = _kernel_calls_per_branch(monkeypatch, mode)
    model = _Head()
    for rows in (1, 5):
        x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(lowered(x), model(x), atol=1e-4, rtol=1e-4)


class _Bf16Layer(torch.nn.Module):
    """Two bf16 linears of a decoder's shape (no vocabulary projection)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.up = torch.nn.Linear(64, 96, bias=False, dtype=torch.bfloat16)
        self.down = torch.nn.Linear(96, 64, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_((torch.randn(p.shape, generator=g) * 0.2).bfloat16())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("mode,bf16_dots,conds", [("auto", True, 0), ("auto", False, 2), ("reduce", True, 2)])
def test_a_linear_whose_kernel_takes_every_width_has_no_branch(monkeypatch: pytest.MonkeyPatch, mode: str,
                                                              bf16_dots: bool, conds: int) -> None:
    """Where one row and many rows both run our kernel (bf16 on a machine with the bf16 dot product),
    the linear is one kernel call; elsewhere a cond on the width, and either way the model's result."""
    monkeypatch.setenv(decode_gemv.ENV_SWITCH, mode)
    monkeypatch.setattr(decode_gemv, "cpu_has_bf16_dots", lambda: bf16_dots)
    width, model = torch.export.Dim("t", max=64), _Bf16Layer()
    example = (torch.randn(3, 64).bfloat16(),)
    program = torch.export.export(model, example, dynamic_shapes=({0: width},)).module()
    assert decode_gemv.use_reductions_for_one_row(program) == 2
    lowered = torch.export.export(program, example, dynamic_shapes=({0: width},), strict=False)
    assert sum(n.target is torch.ops.higher_order.cond for n in lowered.graph.nodes) == conds
    direct = sum(n.target is torch.ops.offgraph_kv.linear_rows.default for n in lowered.graph.nodes)
    assert direct == 2 - conds
    for rows in (1, 5):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).bfloat16()
        torch.testing.assert_close(lowered.module()(x).float(), model(x).float(), atol=2e-2, rtol=2e-2)
