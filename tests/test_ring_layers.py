"""Sliding-window (ring) layers and mixed flat/ring models against the oracle."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TOY, Oracle, Session, greedy, lower, prompt
from executorch.extension.llm.cache.reference_cache import LayerPolicy

MAX_WRITE = 8
MIXED = [LayerPolicy.ring(6), LayerPolicy.flat(), LayerPolicy.ring(16)]  # windows below / above a 10-token prefill
ALL_RING = [LayerPolicy.ring(10)]  # equal to the prefill
TOL = 1e-4


def _ring_pte(pte_factory, layers, dtype=torch.float32):
    return pte_factory(storage_dtype=dtype, initial_capacity=8, layers=tuple(layers), max_write=MAX_WRITE)


def _prefill(session: Session, oracle: Oracle, tokens: torch.Tensor, tol: float = TOL) -> torch.Tensor:
    """Chunked prefill: rings absorb at most MAX_WRITE tokens a step."""
    for start in range(0, tokens.shape[1], MAX_WRITE):
        chunk = tokens[:, start:start + MAX_WRITE]
        got, want = session.step(chunk), oracle.step(chunk)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    return got


@pytest.mark.parametrize("layers", [MIXED, ALL_RING], ids=["mixed-flat-ring", "all-ring"])
def test_generation_wrapping_each_ring_three_times_matches_oracle(pte_factory, model, layers):
    session = Session(_ring_pte(pte_factory, layers))
    oracle = Oracle(model, torch.float32, layers=layers * (TOY.n_layers if len(layers) == 1 else 1))
    got = _prefill(session, oracle, prompt(10))
    nxt = greedy(got)
    largest_ring = max(p.window for p in layers if p.window) + MAX_WRITE - 1
    for _ in range(3 * largest_ring + 5):
        got, want = session.step(nxt), oracle.step(nxt)
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
        assert torch.equal(greedy(got), greedy(want))
        nxt = greedy(got)
    assert session.store.length > 3 * largest_ring


def test_bf16_rings_wrap_with_identical_greedy_tokens(pte_factory, model):
    session = Session(_ring_pte(pte_factory, MIXED, torch.bfloat16))
    oracle = Oracle(model, torch.bfloat16, layers=MIXED)
    got = _prefill(session, oracle, prompt(10), tol=3e-2)
    nxt = greedy(got)
    for _ in range(3 * 23 + 5):
        got, want = session.step(nxt), oracle.step(nxt)
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
        assert torch.equal(greedy(got), greedy(want))
        nxt = greedy(got)
    assert session.store.metrics()["storage_dtype"] == "bf16"


def test_chunk_straddling_the_wrap_point_matches_oracle(pte_factory, model):
    # ring(6) has 6 + 8 - 1 = 13 slots: the second chunk of 8 covers positions 8..15 across slot 12 -> 0.
    session = Session(_ring_pte(pte_factory, MIXED))
    oracle = Oracle(model, torch.float32, layers=MIXED)
    _prefill(session, oracle, prompt(40, seed=3))
    for width in (5, 8, 1, 7, 3):  # continuation chunks after several wraps
        chunk = prompt(width, seed=width)
        torch.testing.assert_close(session.step(chunk), oracle.step(chunk), atol=TOL, rtol=TOL)


def test_failed_step_on_a_full_ring_about_to_wrap_keeps_committed_window(pte_factory, model, capfd):
    session = Session(_ring_pte(pte_factory, MIXED))
    oracle = Oracle(model, torch.float32, layers=MIXED)
    _prefill(session, oracle, prompt(13, seed=5))  # ring(6)'s 13 slots are exactly full
    bad = torch.full((1, MAX_WRITE), 2, dtype=torch.long)
    bad[0, -1] = TOY.vocab_size + 1  # the run fails after the wrap-around writes were issued
    with pytest.raises(RuntimeError):
        session.method.execute([bad, torch.arange(13, 13 + MAX_WRITE).unsqueeze(-1)])
    assert "index out of bounds" in capfd.readouterr().err
    assert session.store.length == 13
    for width in (MAX_WRITE, 1):
        chunk = prompt(width, seed=11 + width)
        torch.testing.assert_close(session.step(chunk), oracle.step(chunk), atol=TOL, rtol=TOL)


def test_step_wider_than_max_write_is_rejected_naming_the_limit(pte_factory, capfd):
    session = Session(_ring_pte(pte_factory, MIXED))
    with pytest.raises(RuntimeError):
        session.step(prompt(MAX_WRITE + 1))
    assert f"step width {MAX_WRITE + 1} (input 0 dim 1) outside [1, max_write={MAX_WRITE}]" in capfd.readouterr().err
    assert session.store.length == 0


def test_ring_bytes_stay_constant_while_flat_layers_grow(pte_factory):
    session = Session(_ring_pte(pte_factory, MIXED))
    row = TOY.n_kv_heads * TOY.head_dim * 4 * 2  # K and V, fp32

    def layer_bytes() -> list:
        return [(l["kind"], l["window"], l["rows"], l["bytes"]) for l in session.store.metrics()["layers"]]

    for _ in range(6):
        session.step(prompt(1))
    after_window = layer_bytes()
    for _ in range(54):
        session.step(prompt(1))  # 10x the window of layer 0
    after_ten = layer_bytes()
    assert after_window[0] == after_ten[0] == ("ring", 6, 13, 13 * row)
    assert after_window[2] == after_ten[2] == ("ring", 16, 23, 23 * row)
    assert after_ten[1][0] == "flat" and after_ten[1][3] > after_window[1][3]
    manifest_windows = [l["window"] for l in session.store.metrics()["layers"]]
    assert manifest_windows == [6, 0, 16]


def test_rewound_or_reset_nan_steps_leave_no_trace_in_ring_slots(tmp_path, model):
    """A ring attends a band of its slots under a mask, and a masked slot still meets the weights as
    0 x value: a rewound or reset step that wrote NaN there must not poison later steps."""
    poisoned = copy.deepcopy(model)
    nan_token = TOY.vocab_size - 1
    with torch.no_grad():
        poisoned.tok_embeddings.weight[nan_token] = float("nan")  # this token's K/V rows are NaN
    path = tmp_path / "poisoned_ring.pte"
    path.write_bytes(lower(poisoned, storage_dtype=torch.float32, initial_capacity=8, layers=tuple(MIXED),
                           max_write=MAX_WRITE))
    tokens = prompt(6, seed=9)
    clean_tokens = tokens.clamp(max=nan_token - 1)
    nan_step = torch.full((1, 2), nan_token)

    clean = Session(path)
    clean.step(clean_tokens)
    want = [clean.step(clean_tokens[:, i:i + 1]) for i in range(4)]
    assert all(torch.isfinite(w).all() for w in want)

    rewound = Session(path)
    rewound.step(clean_tokens)
    assert not torch.isfinite(rewound.step(nan_step)).all()
    rewound.store.rewind(2)
    rewound.length -= 2
    for i, w in enumerate(want):
        torch.testing.assert_close(rewound.step(clean_tokens[:, i:i + 1]), w, atol=0, rtol=0)

    for release in (False, True):
        reset = Session(path)
        reset.step(clean_tokens)
        reset.step(nan_step)
        reset.store.reset(release_memory=release)
        reset.length = 0
        reset.step(clean_tokens)
        for i, w in enumerate(want):
            torch.testing.assert_close(reset.step(clean_tokens[:, i:i + 1]), w, atol=0, rtol=0)
