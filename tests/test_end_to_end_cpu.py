"""The CPU pipeline end to end: partitioner -> private tensors -> C++ delegate in executorch.runtime."""

from __future__ import annotations

import pytest
import torch
from conftest import TOY, Oracle, Session, greedy, load_configured, prompt


TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
INITIAL = 8


def _bytes(capacity: int, dtype: torch.dtype) -> int:
    # K and V, every layer: capacity rows of [H_kv, D] in the storage dtype.
    return TOY.n_layers * 2 * capacity * TOY.n_kv_heads * TOY.head_dim * dtype.itemsize


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_prefill_and_decode_across_growth_boundaries_match_oracle(pte_factory, model, dtype):
    session = Session(pte_factory(storage_dtype=dtype, initial_capacity=INITIAL))
    oracle = Oracle(model, dtype)
    # Prefill in uneven chunks, then decode greedily past 8 -> 16 -> 32 -> 64 -> 128.
    capacities = {session.store.capacity}
    tokens = prompt(11)
    for chunk in (tokens[:, :5], tokens[:, 5:6], tokens[:, 6:11]):
        got, want = session.step(chunk), oracle.step(chunk)
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    capacities.add(session.store.capacity)
    nxt, ref_nxt = greedy(got), greedy(want)
    for _ in range(60):
        assert torch.equal(nxt, ref_nxt), "greedy tokens diverged from the eager reference"
        got, want = session.step(nxt), oracle.step(ref_nxt)
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
        nxt, ref_nxt = greedy(got), greedy(want)
        capacities.add(session.store.capacity)
    assert session.store.length == 71
    assert sorted(capacities) == [8, 16, 32, 64, 128]
    assert session.store.metrics()["storage_dtype"] == {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def test_copy_growth_metrics_follow_the_growth_rule_exactly(pte_factory):
    # Copy growth's accounting, to the byte (map growth's: test_map_growth.py).
    session = load_configured(pte_factory(storage_dtype=torch.bfloat16, initial_capacity=INITIAL), growth="copy")
    m = session.store.metrics()
    assert (m["length"], m["capacity"], m["growths"]) == (0, 8, 0)
    assert m["allocated_bytes"] == _bytes(8, torch.bfloat16) == m["peak_bytes"]
    session.step(prompt(8))  # fits exactly: no growth
    assert session.store.metrics()["growths"] == 0
    session.step(prompt(1))  # 9 rows: 8 -> 16
    m = session.store.metrics()
    assert (m["length"], m["capacity"], m["growths"]) == (9, 16, 1)
    assert m["allocated_bytes"] == _bytes(16, torch.bfloat16)
    # Old and new storage coexist during the copy.
    assert m["peak_bytes"] == _bytes(8, torch.bfloat16) + _bytes(16, torch.bfloat16)
    session.step(prompt(20))  # 29 rows: 16 -> 32 in one growth
    m = session.store.metrics()
    assert (m["capacity"], m["growths"]) == (32, 2)
    assert m["peak_bytes"] == _bytes(16, torch.bfloat16) + _bytes(32, torch.bfloat16)
    per_layer = _bytes(32, torch.bfloat16) // TOY.n_layers
    assert [(l["kind"], l["rows"], l["bytes"]) for l in m["layers"]] == [("flat", 32, per_layer)] * TOY.n_layers


def test_configured_growth_factor_and_capacities_apply_at_load(pte_factory):
    path = pte_factory(storage_dtype=torch.float32, initial_capacity=INITIAL)
    session = load_configured(path, initial_capacity=4, max_capacity=40, growth_factor=1.5)
    m = session.store.metrics()
    assert (m["capacity"], m["max_capacity"], m["growth_factor"]) == (4, 40, 1.5)
    caps = []
    for _ in range(40):
        session.step(prompt(1))
        caps.append(session.store.capacity)
    assert sorted(set(caps)) == [4, 6, 9, 14, 21, 32, 40]
    with pytest.raises(RuntimeError):
        session.step(prompt(1))  # 41 > max_capacity
    assert session.store.length == 40


def test_max_capacity_above_compiled_bound_is_rejected_at_load(pte_factory, capfd):
    path = pte_factory(storage_dtype=torch.float32, initial_capacity=INITIAL)
    with pytest.raises(RuntimeError):
        load_configured(path, max_capacity=(1 << 20) + 1)
    assert "exceeds what the compiled code supports" in capfd.readouterr().err


def test_failed_run_leaves_length_and_history_unchanged(pte_factory, model, capfd):
    session = Session(pte_factory(storage_dtype=torch.float32, initial_capacity=INITIAL))
    oracle = Oracle(model, torch.float32)
    history = prompt(8)
    session.step(history)
    oracle.step(history)
    # A malformed input: token id past the vocabulary, in a step that also forces a growth.
    bad = torch.tensor([[3, TOY.vocab_size + 5]])
    with pytest.raises(RuntimeError):
        session.method.execute([bad, torch.tensor([[8], [9]])])
    assert "index out of bounds" in capfd.readouterr().err
    assert session.store.length == 8
    nxt = prompt(3, seed=7)
    torch.testing.assert_close(session.step(nxt), oracle.step(nxt), atol=1e-4, rtol=1e-4)


def test_rejected_steps_name_the_problem_and_change_nothing(pte_factory, capfd):
    path = pte_factory(storage_dtype=torch.float32, initial_capacity=INITIAL)
    session = load_configured(path, max_capacity=12)
    session.step(prompt(10))
    before = session.store.metrics()
    with pytest.raises(RuntimeError):
        session.method.execute([prompt(3), torch.tensor([[10], [11], [12]])])
    assert "beyond max_capacity 12 (2 remaining)" in capfd.readouterr().err
    with pytest.raises(RuntimeError):
        session.method.execute([torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, 1, dtype=torch.long)])
    assert "step width 0 (input 0 dim 1) outside [1, max_write=" in capfd.readouterr().err
    assert session.store.metrics() == before
    session.step(prompt(2))  # exactly fills max_capacity
    assert session.store.length == 12


def test_reset_replays_the_same_tokens_and_release_drops_memory(pte_factory):
    session = Session(pte_factory(storage_dtype=torch.bfloat16, initial_capacity=INITIAL))

    def generate(n: int) -> list:
        out, nxt = [], prompt(6)
        for _ in range(n):
            nxt = greedy(session.step(nxt))
            out.append(int(nxt))
        return out

    at_load = session.store.metrics()["allocated_bytes"]
    first = generate(30)
    grown = session.store.metrics()["allocated_bytes"]
    session.store.reset()
    session.length = 0
    assert session.store.length == 0 and session.store.metrics()["allocated_bytes"] == grown
    assert generate(30) == first
    session.store.reset(release_memory=True)
    session.length = 0
    m = session.store.metrics()
    assert (m["length"], m["capacity"], m["allocated_bytes"]) == (0, INITIAL, at_load)
    assert at_load >= _bytes(INITIAL, torch.bfloat16)
    assert generate(30) == first


def test_two_loaded_methods_own_separate_stores(pte_factory):
    path = pte_factory(storage_dtype=torch.float32, initial_capacity=INITIAL)
    a, b = Session(path), Session(path)
    assert a.store is not b.store
    a.step(prompt(5))
    assert (a.store.length, b.store.length) == (5, 0)
