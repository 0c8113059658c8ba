"""Our CPU attention kernel over the stored rows, compiled into an AOTInductor
program the way every CPU program gets it (``backend/cpu_kernels.py``), against
fp32 attention over the same stored rows: fp32, bf16 and fp16 storage, head
dims with and without a fixed-length loop, value head dims of their own, padded
rows, GQA groups, lengths on both sides of the softmax block and of a thread's
share; unmasked with each query's log-sum-exp (``rows_attend_with_lse``), and a
flat layer's whole step of any width, lower-right causal (``rows_attend_causal``).
"""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch
from torch.export import Dim

from compiled_calls import run_with_threads

from offgraph_kv.backend.aoti_compile import compile_shared_object
from offgraph_kv.backend.cpu_kernels import rows_attend_causal_reference, rows_attend_with_lse_reference

# (storage dtype, key head dim, value head dim, padding after each head's elements)
CASES: List[Tuple[torch.dtype, int, int, int]] = [
    (torch.float32, 64, 64, 0),
    (torch.bfloat16, 128, 128, 0),
    (torch.float16, 64, 64, 8),     # rows wider than the heads they hold
    (torch.bfloat16, 40, 24, 0),    # no fixed-length loop; a value head dim of its own
]


class _Calls(torch.nn.Module):
    """One kernel call per case, over ``[1, S, H_kv, D(+pad)]`` stores as the step binds them
    (``groups`` set: the causal form, queries ``[1, H_kv, groups * T, D]``)."""

    def __init__(self, groups: int = 0) -> None:
        super().__init__()
        self.groups = groups

    def forward(self, q0: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, q1: torch.Tensor, k1: torch.Tensor,
                v1: torch.Tensor, q2: torch.Tensor, k2: torch.Tensor, v2: torch.Tensor, q3: torch.Tensor,
                k3: torch.Tensor, v3: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        args = (q0, k0, v0, q1, k1, v1, q2, k2, v2, q3, k3, v3)
        outs = []
        for i, (_, kd, vd, _) in enumerate(CASES):
            q, k_store, v_store = args[3 * i: 3 * i + 3]
            k = k_store[..., :kd].transpose(1, 2)
            v = v_store[..., :vd].transpose(1, 2)
            if self.groups:
                outs.append(torch.ops.offgraph_kv.rows_attend_causal(q, k, v, 0.37, self.groups))
            else:
                outs += list(torch.ops.offgraph_kv.rows_attend_with_lse(q, k, v, 0.37))
        return tuple(outs)


def _inputs(heads: int, groups: int, rows: int, seed: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    args = []
    for dtype, kd, vd, pad in CASES:
        args.append(torch.randn(1, heads, groups, kd, generator=g))
        args.append((torch.randn(1, rows, heads, kd + pad, generator=g) * 2).to(dtype))
        args.append(torch.randn(1, rows, heads, vd + pad, generator=g).to(dtype))
    return args


def _compiled(tmp_path_factory: pytest.TempPathFactory, groups: int) -> "torch._C._aoti.AOTIModelContainerRunnerCpu":
    args = _inputs(2, 3 if not groups else groups * 5, 70, 0)
    s, h, r = Dim("rows", min=1, max=1 << 20), Dim("heads", min=1, max=64), Dim("queries", min=1, max=1 << 12)
    shapes = [({1: h, 2: r}, {1: s, 2: h}, {1: s, 2: h}) for _ in CASES]
    program = torch.export.export(_Calls(groups), tuple(args), dynamic_shapes=tuple(x for c in shapes for x in c))
    code = compile_shared_object(program, args, "cpu")
    path = tmp_path_factory.mktemp("offgraph_kv_kernel") / "calls.so"
    path.write_bytes(code.so_bytes)
    return torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)


@pytest.fixture(scope="module")
def compiled_calls(tmp_path_factory: pytest.TempPathFactory) -> "torch._C._aoti.AOTIModelContainerRunnerCpu":
    return _compiled(tmp_path_factory, 0)


@pytest.fixture(scope="module")
def compiled_causal_calls(tmp_path_factory: pytest.TempPathFactory) -> "torch._C._aoti.AOTIModelContainerRunnerCpu":
    return _compiled(tmp_path_factory, CAUSAL_GROUPS)


CAUSAL_GROUPS = 3


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads,groups,rows", [(1, 1, 1), (2, 3, 63), (3, 3, 64), (3, 3, 65), (1, 8, 600),
                                                (4, 2, 1100), (2, 1, 2049)])
def test_decode_kernel_in_a_compiled_program_matches_fp32_attention_over_the_stored_rows(
        compiled_calls, heads, groups, rows, threads):
    args = _inputs(heads, groups, rows, seed=rows * 7 + heads)
    got = run_with_threads(compiled_calls, args, threads)  # decode: 2 threads split rows from 1,024
    for i, (dtype, kd, vd, _) in enumerate(CASES):
        q, k_store, v_store = args[3 * i: 3 * i + 3]
        want_out, want_lse = rows_attend_with_lse_reference(
            q, k_store[..., :kd].transpose(1, 2), v_store[..., :vd].transpose(1, 2), 0.37)
        out, lse = got[2 * i], got[2 * i + 1]
        assert out.dtype == lse.dtype == torch.float32, dtype
        assert out.shape == (1, heads, groups, vd) and out.is_contiguous()
        torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5, msg=lambda m: f"{dtype} lse: {m}")
        torch.testing.assert_close(out, want_out, atol=2e-5, rtol=2e-5, msg=lambda m: f"{dtype} out: {m}")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads,width,rows", [(1, 1, 1), (3, 1, 70), (2, 2, 2), (3, 5, 64), (1, 64, 64),
                                               (3, 64, 200), (2, 70, 130), (2, 3, 2049)])
def test_causal_step_kernel_in_a_compiled_program_matches_fp32_attention_with_a_lower_right_mask(
        compiled_causal_calls, heads, width, rows, threads):
    """Widths 1 (decode path) and 2-70 (wide path: register tiles, masked blocks skipped), the
    step's rows the last of the store's: query i of the step sees rows 0 .. S - T + i."""
    args = _inputs(heads, CAUSAL_GROUPS * width, rows, seed=rows * 11 + width)
    got = run_with_threads(compiled_causal_calls, args, threads)
    for i, (dtype, kd, vd, _) in enumerate(CASES):
        q, k_store, v_store = args[3 * i: 3 * i + 3]
        want = rows_attend_causal_reference(q, k_store[..., :kd].transpose(1, 2),
                                            v_store[..., :vd].transpose(1, 2), 0.37, CAUSAL_GROUPS)
        out = got[i]
        assert out.dtype == torch.float32 and out.shape == (1, heads, CAUSAL_GROUPS * width, vd)
        assert out.is_contiguous()
        torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5, msg=lambda m: f"{dtype} out: {m}")


def test_causal_step_kernel_refuses_query_rows_that_are_not_whole_groups_or_wider_than_the_store(
        compiled_causal_calls):
    """4 query rows are not a whole number of 3-member groups; 3 x 5 rows over 4 stored rows is a
    step wider than the store: the kernel fails the call (the runner raises), it does not guess."""
    for queries, rows in ((4, 10), (CAUSAL_GROUPS * 5, 4)):
        with pytest.raises(Exception):
            compiled_causal_calls.run(_inputs(1, queries, rows, seed=1))
