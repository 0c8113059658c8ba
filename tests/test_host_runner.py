"""The C++ Module runner (used where executorch.runtime cannot exchange tensors
with the torch in the process) gives exactly what executorch.runtime gives."""

from __future__ import annotations

import pytest
import torch
from conftest import Session, configured, greedy, prompt
from model import positions

import offgraph_kv.runtime as rt
from offgraph_kv.runtime import HostMethod


@pytest.mark.skipif(not rt.pybindings_match_torch(), reason="compares against executorch.runtime")
def test_host_runner_matches_executorch_runtime_across_growth(pte_factory):
    path = pte_factory(storage_dtype=torch.float32, initial_capacity=8)
    reference = Session(path)
    host = HostMethod(path)
    store = rt.latest_store()
    tokens, length = prompt(7), 0
    for _ in range(30):
        w = tokens.shape[1]
        want = reference.step(tokens)
        got = host.execute([tokens, positions(length, w)])[0]
        length += w
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
        tokens = greedy(got)
    assert store.length == 7 + 29 and store.metrics()["growths"] == 3  # 8 -> 16 -> 32 -> 64


def test_host_runner_rejected_step_raises_and_keeps_the_cache(pte_factory, capfd):
    path = pte_factory(storage_dtype=torch.float32, initial_capacity=8)
    with configured(max_capacity=12):
        host = HostMethod(path)
    store = rt.latest_store()
    host.execute([prompt(10), positions(0, 10)])
    with pytest.raises(RuntimeError, match="executing 'forward' failed"):
        host.execute([prompt(3), positions(10, 3)])
    assert "beyond max_capacity 12" in capfd.readouterr().err
    assert store.length == 10


def test_host_runner_names_bad_inputs(pte_factory, tmp_path):
    path = pte_factory(storage_dtype=torch.float32, initial_capacity=8)
    host = HostMethod(path)
    with pytest.raises(TypeError, match="input 1: expected a torch.Tensor"):
        host.execute([prompt(2), 5])
    with pytest.raises(RuntimeError, match="loading program"):
        HostMethod(tmp_path / "missing.pte")
