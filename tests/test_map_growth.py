"""Map growth on the CPU, end to end: address space reserved for max_capacity rows at load, backed as the
store grows; nothing copied, no address changes. The same program under copy growth gives the same logits."""

from __future__ import annotations

import pytest
import torch
from conftest import TOY, Oracle, Session, generate_checked, load_configured, prompt

import offgraph_kv.runtime

INITIAL = 8


def _generate(session: Session, oracle: Oracle) -> "tuple[list, list]":
    return generate_checked(session, oracle, ((0, 5), (5, 6), (6, 11)), 1e-4)


def test_map_growth_generation_equals_the_oracle_and_copy_growth_bit_for_bit(pte_factory, model):
    path = pte_factory(storage_dtype=torch.float32, initial_capacity=INITIAL)
    mapped = load_configured(path, growth="map")
    copied = load_configured(path, growth="copy")
    assert mapped.store.metrics()["growth"] == "map" and copied.store.metrics()["growth"] == "copy"
    got_map, addr_map = _generate(mapped, Oracle(model, torch.float32))
    got_copy, addr_copy = _generate(copied, Oracle(model, torch.float32))
    for a, b in zip(got_map, got_copy):
        assert torch.equal(a, b), "map and copy growth must give the same logits"
    m, c = mapped.store.metrics(), copied.store.metrics()
    assert (m["length"], m["capacity"], m["growths"]) == (c["length"], c["capacity"], c["growths"]) == (71, 128, 4)
    # Map growth: no address ever changed. Copy growth moved the flat tensors.
    assert all(a == addr_map[0] for a in addr_map)
    assert any(a != addr_copy[0] for a in addr_copy)


def test_map_growth_reserves_max_capacity_counts_no_old_new_pair_and_reset_releases(pte_factory):
    path = pte_factory(storage_dtype=torch.float32, initial_capacity=INITIAL)
    session = load_configured(path, growth="map", max_capacity=4096)
    m = session.store.metrics()
    row = TOY.n_kv_heads * TOY.head_dim * 4
    tensors = 2 * TOY.n_layers
    assert m["reserved_bytes"] >= tensors * 4096 * row
    initial = m["allocated_bytes"]
    assert m["peak_bytes"] == initial >= tensors * INITIAL * row
    at_load = session.store.addresses()
    session.step(prompt(30))
    for _ in range(600):
        session.step(prompt(1))
    m = session.store.metrics()
    assert (m["length"], m["capacity"], m["growths"]) == (630, 1024, 6)  # 8 -> 32 (the prefill), then doubling
    # Backed: the capacity's rows in whole pages, and never an old and a new arena at once.
    assert tensors * 1024 * row <= m["allocated_bytes"] < tensors * (1024 * row + 4096 * 16)
    assert m["peak_bytes"] == m["allocated_bytes"]
    session.store.reset(release_memory=True)
    session.length = 0
    m = session.store.metrics()
    assert (m["length"], m["capacity"], m["allocated_bytes"], m["peak_bytes"]) == (0, INITIAL, initial, initial)
    assert session.store.addresses() == at_load


def test_growth_option_rejects_anything_but_map_copy_or_auto() -> None:
    with pytest.raises(ValueError, match="growth must be 'map', 'copy' or 'auto'"):
        offgraph_kv.runtime.configure(growth="mmap")
    # (the C++ side refuses it too, without the Python check: runtime/tests/test_backend_options.cpp)
    assert offgraph_kv.runtime.options()["growth"] == ""
    offgraph_kv.runtime.configure(growth="copy")
    try:
        assert offgraph_kv.runtime.options()["growth"] == "copy"
    finally:
        offgraph_kv.runtime.configure()
    assert offgraph_kv.runtime.options()["growth"] == ""


def test_default_growth_on_the_cpu_is_map(pte_factory):
    session = Session(pte_factory(storage_dtype=torch.float32, initial_capacity=INITIAL))
    m = session.store.metrics()
    assert m["growth"] == "map" and m["growth_note"] == ""


def test_configure_refuses_infinite_growth_factors_and_fractional_capacities() -> None:
    before = offgraph_kv.runtime.options()
    for kwargs, message in (({"growth_factor": float("inf")}, "growth_factor must be a finite number > 1"),
                            ({"growth_factor": float("nan")}, "growth_factor must be a finite number > 1"),
                            ({"initial_capacity": 1.7}, "initial_capacity must be a whole number"),
                            ({"rewind_budget": 2.5}, "rewind_budget must be a whole number")):
        with pytest.raises(ValueError, match=message):
            offgraph_kv.runtime.configure(**kwargs)
        assert offgraph_kv.runtime.options() == before  # nothing applied
    # The C++ side refuses them without the Python check (runtime/tests/test_backend_options.cpp).
    with pytest.raises(ValueError, match="growth_factor .inf."):
        offgraph_kv.runtime.set_options(0, 0, "inf", -1, 0, "", "")
    assert offgraph_kv.runtime.options() == before
