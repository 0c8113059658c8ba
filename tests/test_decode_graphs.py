"""CUDA graphs of decode steps (issue 19): what a machine without a GPU can check.

The captures themselves run on the H200 (tests/test_cuda.py: replays equal the
uncaptured steps bit for bit across growths, wraps, rewinds and rejected steps).
"""

from __future__ import annotations

import pytest
import torch
from conftest import Session, greedy, prompt
from test_bad_programs import _manifest_span

import offgraph_kv.runtime
from offgraph_kv.schemas.manifest import CompiledInterface


def test_cuda_graphs_option_is_checked_and_reported() -> None:
    with pytest.raises(ValueError, match="cuda_graphs must be True, False or None"):
        offgraph_kv.runtime.configure(cuda_graphs="yes")
    assert offgraph_kv.runtime.options()["cuda_graphs"] == ""
    offgraph_kv.runtime.configure(cuda_graphs=False)
    try:
        assert offgraph_kv.runtime.options()["cuda_graphs"] == "off"
    finally:
        offgraph_kv.runtime.configure()
    assert offgraph_kv.runtime.options()["cuda_graphs"] == ""


def test_cpu_programs_read_lengths_from_shapes_and_never_capture(pte_factory):
    # Only code whose attention reads the length from device memory may be
    # replayed as the context grows; the export records which (covered by the
    # code's digest), and a CPU program is not such code.
    path = pte_factory(storage_dtype=torch.bfloat16, initial_capacity=8)
    _, manifest, _ = _manifest_span(path.read_bytes())
    assert CompiledInterface.from_bytes(manifest.compiled_interface).lengths_from_device is False
    session = Session(path)
    nxt = greedy(session.step(prompt(5)))
    for _ in range(4):
        nxt = greedy(session.step(nxt))
    m = session.store.metrics()
    assert (m["graph_captures"], m["graph_replays"], m["steps"]) == (0, 0, 5)
