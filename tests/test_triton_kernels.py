"""The CUDA update-and-attend Triton kernels against a plain PyTorch reference.

Without a GPU they run on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, set by conftest before any kernel is defined); on a
CUDA machine the same tests run the compiled kernels. CI installs no triton,
so there the whole module skips at no cost.
"""

from __future__ import annotations

from typing import Tuple

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (CI does not install it: these kernels are CUDA-only "
                                     "and their tests cost CI nothing)")

from offgraph_kv.backend.triton_attention import HAVE_TRITON, reference_update_attend, update_attend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
GROUPS = pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)], ids=["gqa1", "gqa4"])
HEAD_DIMS = pytest.mark.parametrize("d", [64, 128])


def _step(hq: int, hkv: int, d: int, t: int, rows: int, dtype: torch.dtype,
          seed: int) -> Tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

    return r(1, hq, t, d), r(1, hkv, t, d), r(1, hkv, t, d), r(1, rows, hkv, d), r(1, rows, hkv, d)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
           length: int, window: int) -> None:
    scale = q.shape[-1] ** -0.5
    k_ref, v_ref = k_store.clone(), v_store.clone()
    got = update_attend(q, k, v, k_store, v_store, torch.tensor([length], device=DEVICE), window, scale, q.dtype)
    want = reference_update_attend(q, k, v, k_ref, v_ref, length, window, scale, q.dtype)
    assert HAVE_TRITON
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[q.dtype], rtol=TOL[q.dtype])
    # The write is exact (a copy in the storage dtype), and touches nothing else.
    assert torch.equal(k_store, k_ref) and torch.equal(v_store, v_ref)


@DTYPES
@GROUPS
@HEAD_DIMS
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("length", [1, 7, 300])
def test_flat_step_writes_at_length_and_attends_lower_right_causal(length, t, d, hq, hkv, dtype):
    q, k, v, ks, vs = _step(hq, hkv, d, t, length + t, dtype, seed=length * 10 + t)
    _check(q, k, v, ks, vs, length, window=0)


@DTYPES
@GROUPS
@pytest.mark.parametrize("d", [64, 128])
def test_flat_step_reads_length_from_the_tensor_not_the_bound_extent(d, hq, hkv, dtype):
    # Storage bound at its whole capacity (what graph replay binds): rows past
    # length + T are neither read nor written.
    q, k, v, ks, vs = _step(hq, hkv, d, 5, 512, dtype, seed=3)
    _check(q, k, v, ks, vs, 200, window=0)


@DTYPES
@GROUPS
@HEAD_DIMS
@pytest.mark.parametrize("length,t", [(3, 5), (9, 1), (40, 1), (38, 5), (61, 5)],
                         ids=["before-wrap", "decode-full-band", "decode-wrapped", "step-straddles-wrap",
                              "wrapped-twice"])
def test_ring_step_writes_at_position_mod_slots_and_attends_its_band(length, t, d, hq, hkv, dtype):
    window, max_write = 16, 5
    slots = window + max_write - 1
    q, k, v, ks, vs = _step(hq, hkv, d, t, slots, dtype, seed=length + t)
    _check(q, k, v, ks, vs, length, window)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_long_decode_spreads_over_splits_and_matches_reference(dtype):
    # Long enough that every split holds several key blocks (and the last one a partial block).
    q, k, v, ks, vs = _step(32, 8, 128, 1, 4200, dtype, seed=11)
    _check(q, k, v, ks, vs, 4199, window=0)


@DTYPES
@GROUPS
@pytest.mark.parametrize("length,t", [(0, 70), (37, 70), (130, 17)], ids=["prompt", "chunk-after-70", "gqa-wide"])
def test_wide_flat_step_takes_the_wide_variant_and_attends_lower_right_causal(length, t, hq, hkv, dtype):
    # More than 64 folded query rows (t x the group) run the wide (64-row block) variant;
    # (130, 17) is wide only with a group of 4 (68 rows), narrow with 1.
    q, k, v, ks, vs = _step(hq, hkv, 64, t, length + t + 3, dtype, seed=length + t)
    _check(q, k, v, ks, vs, length, window=0)


@DTYPES
@pytest.mark.parametrize("length", [0, 20, 95], ids=["before-wrap", "straddles-wrap", "wrapped"])
def test_wide_ring_step_writes_each_position_mod_slots_and_attends_its_band(length, dtype):
    window, max_write, t = 32, 70, 70
    slots = window + max_write - 1
    q, k, v, ks, vs = _step(8, 2, 64, t, slots, dtype, seed=length)
    _check(q, k, v, ks, vs, length, window)


@pytest.mark.parametrize("window", [0, 32], ids=["flat", "ring"])
@pytest.mark.parametrize("t", [1, 5, 70], ids=["decode", "narrow", "wide"])
def test_one_split_writes_the_output_itself_without_the_combine(t, window, monkeypatch):
    # With no programs to spare for splitting (a GPU busy with many heads, or
    # long wide steps) the partial kernel normalises and writes the output, and
    # the combine launch has no programs.
    from offgraph_kv.backend import triton_attention as ta

    monkeypatch.setattr(ta, "PROGRAMS_PER_SM", 0)
    monkeypatch.setattr(ta, "RING_PROGRAMS_PER_SM", 0)
    monkeypatch.setattr(ta, "DECODE", {kind: s and (0,) + s[1:] for kind, s in ta.DECODE.items()})
    length = 150
    rows = window + 70 - 1 if window else length + t
    q, k, v, ks, vs = _step(8, 2, 64, t, rows, torch.bfloat16, seed=t + window)
    _check(q, k, v, ks, vs, length, window)


@pytest.mark.parametrize("window,length,rows", [(0, 700, 703), (300, 1000, 310)], ids=["flat", "ring-wrapped"])
def test_gqa8_decode_over_many_splits_matches_reference_twice_in_a_row(window, length, rows):
    # GQA 8 (16 query heads on 2 KV heads): each KV head's keys spread over many
    # splits, relative positions across a ring's wrap; twice, at two lengths.
    for seed in (1, 2):
        q, k, v, ks, vs = _step(16, 2, 128, 1, rows, torch.bfloat16, seed=seed)
        _check(q, k, v, ks, vs, length + seed, window)


@pytest.mark.parametrize("kernel", ["cuda-cores", "tl.dot"])
@pytest.mark.parametrize("hq,hkv", [(3, 3), (6, 2), (24, 2)], ids=["gqa1", "gqa3", "gqa12"])
@pytest.mark.parametrize("window,length,rows", [(0, 150, 151), (64, 150, 80)], ids=["flat", "ring-wrapped"])
def test_decode_step_matches_reference_on_either_kernel_for_any_group(window, length, rows, hq, hkv, kernel,
                                                                       monkeypatch):
    # One-token steps take the CUDA-core kernel (a group padded to a power of two
    # where it is not one) unless a layer kind's DECODE setting sends them to the
    # 16-row tl.dot kernel; both must agree with the reference.
    from offgraph_kv.backend import triton_attention as ta

    setting = (2, 32, 4, 2) if kernel == "cuda-cores" else None
    monkeypatch.setattr(ta, "DECODE", {"flat": setting, "ring": setting})
    q, k, v, ks, vs = _step(hq, hkv, 64, 1, rows, torch.bfloat16, seed=hq + window)
    _check(q, k, v, ks, vs, length, window)
