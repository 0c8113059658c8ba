"""Our CPU decode-attention kernel, compiled into an AOTInductor program the way
every CPU program gets it (``backend/cpu_kernels.py``), against fp32 attention
over the same stored rows: fp32, bf16 and fp16 storage, head dims with and
without a fixed-length loop, value head dims of their own, padded rows, GQA
groups, lengths on both sides of the softmax block and of a thread's share.
"""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch
from torch.export import Dim

from offgraph_kv.backend.aoti_compile import compile_shared_object
from offgraph_kv.backend.cpu_kernels import rows_attend_with_lse_reference

# (storage dtype, key head dim, value head dim, padding after each head's elements)
CASES: List[Tuple[torch.dtype, int, int, int]] = [
    (torch.float32, 64, 64, 0),
    (torch.bfloat16, 128, 128, 0),
    (torch.float16, 64, 64, 8),     # rows wider than the heads they hold
    (torch.bfloat16, 40, 24, 0),    # no fixed-length loop; a value head dim of its own
]


class _Calls(torch.nn.Module):
    """One kernel call per case, over ``[1, S, H_kv, D(+pad)]`` stores as the step binds them."""

    def forward(self, q0: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, q1: torch.Tensor, k1: torch.Tensor,
                v1: torch.Tensor, q2: torch.Tensor, k2: torch.Tensor, v2: torch.Tensor, q3: torch.Tensor,
                k3: torch.Tensor, v3: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        args = (q0, k0, v0, q1, k1, v1, q2, k2, v2, q3, k3, v3)
        outs = []
        for i, (_, kd, vd, _) in enumerate(CASES):
            q, k_store, v_store = args[3 * i: 3 * i + 3]
            k = k_store[..., :kd].transpose(1, 2)
            v = v_store[..., :vd].transpose(1, 2)
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


@pytest.fixture(scope="module")
def compiled_calls(tmp_path_factory: pytest.TempPathFactory) -> "torch._C._aoti.AOTIModelContainerRunnerCpu":
    args = _inputs(2, 3, 70, 0)
    s, h, r = Dim("rows", min=1, max=1 << 20), Dim("heads", min=1, max=64), Dim("groups", min=1, max=64)
    shapes = [({1: h, 2: r}, {1: s, 2: h}, {1: s, 2: h}) for _ in CASES]
    program = torch.export.export(_Calls(), tuple(args), dynamic_shapes=tuple(x for c in shapes for x in c))
    code = compile_shared_object(program, args, "cpu")
    path = tmp_path_factory.mktemp("offgraph_kv_kernel") / "calls.so"
    path.write_bytes(code.so_bytes)
    return torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads,groups,rows", [(1, 1, 1), (2, 3, 63), (3, 3, 64), (3, 3, 65), (1, 8, 600),
                                                (4, 2, 1100), (2, 1, 2049)])
def test_decode_kernel_in_a_compiled_program_matches_fp32_attention_over_the_stored_rows(
        compiled_calls, heads, groups, rows, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the kernel splits rows over what OpenMP allows (2: from 1,024 rows)
    try:
        args = _inputs(heads, groups, rows, seed=rows * 7 + heads)
        got = compiled_calls.run(args)
    finally:
        torch.set_num_threads(before)
    for i, (dtype, kd, vd, _) in enumerate(CASES):
        q, k_store, v_store = args[3 * i: 3 * i + 3]
        want_out, want_lse = rows_attend_with_lse_reference(
            q, k_store[..., :kd].transpose(1, 2), v_store[..., :vd].transpose(1, 2), 0.37)
        out, lse = got[2 * i], got[2 * i + 1]
        assert out.dtype == lse.dtype == torch.float32, dtype
        assert out.shape == (1, heads, groups, vd) and out.is_contiguous()
        torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5, msg=lambda m: f"{dtype} lse: {m}")
        torch.testing.assert_close(out, want_out, atol=2e-5, rtol=2e-5, msg=lambda m: f"{dtype} out: {m}")
