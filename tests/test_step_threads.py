"""The load-time option num_threads: checked at the ExecuTorch boundary, applied
to the compiled code's steps, and the caller's own thread settings kept."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import Oracle, generate_checked, load_configured, prompt

import offgraph_kv.runtime


def test_num_threads_option_is_rejected_naming_the_option_and_the_value():
    with pytest.raises(ValueError, match=r"num_threads.*got 0"):
        offgraph_kv.runtime.configure(num_threads=0)
    # (the C++ boundary refuses it too, naming the option and the value, without
    # the Python check: runtime/tests/test_backend_options.cpp)
    assert offgraph_kv.runtime.options()["num_threads"] == 0  # nothing applied


def test_steps_on_more_threads_than_cores_match_the_oracle_and_keep_the_callers_threads(pte_factory, model):
    # More threads than this machine has cores: no thread count is baked into
    # the compiled code (backend/aoti_compile.py), so this is only slower.
    threads = 2 * (os.cpu_count() or 1) + 1
    session = load_configured(pte_factory(storage_dtype=torch.bfloat16), num_threads=threads)
    oracle = Oracle(model, torch.bfloat16)
    before = torch.get_num_threads()
    generate_checked(session, oracle, [(0, 6), (6, 11)], tol=3e-2, steps=8)
    assert torch.get_num_threads() == before  # the step's setting was undone


def test_default_and_explicit_thread_counts_compute_the_same_logits(pte_factory):
    path = pte_factory(storage_dtype=torch.bfloat16)
    tokens = prompt(12)
    outs = []
    for threads in (None, 1, 2):
        session = load_configured(path, num_threads=threads)
        outs.append([session.step(tokens[:, :7]), session.step(tokens[:, 7:8]), session.step(tokens[:, 8:12])])
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
