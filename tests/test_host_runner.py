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


def test_cpp_greedy_loop_gives_the_python_loops_tokens_and_stops_at_a_stop_id(pte_factory):
    path = pte_factory(storage_dtype=torch.float32, initial_capacity=8)
    python_loop, cpp_loop = HostMethod(path), HostMethod(path)
    first = [greedy(m.execute([prompt(5), positions(0, 5)])[0]) for m in (python_loop, cpp_loop)][0]
    want, tok = [], first
    for i in range(20):  # across growths: 8 -> 16 -> 32 rows
        tok = greedy(python_loop.execute([tok, positions(5 + i, 1)])[0])
        want.append(int(tok))
    got, step_ns = cpp_loop.decode_greedy([first, positions(5, 1)], steps=20)
    assert got == want and len(step_ns) == 20 and all(ns > 0 for ns in step_ns)
    assert cpp_loop.store.length == python_loop.store.length == 25

    stop = want[3]
    again = HostMethod(path)
    again.execute([prompt(5), positions(0, 5)])
    got, _ = again.decode_greedy([first, positions(5, 1)], steps=20, stop_ids=[stop])
    assert got == want[:want.index(stop) + 1] and again.store.length == 5 + len(got)


def test_cpp_greedy_loop_names_bad_requests_and_keeps_the_steps_before_a_failure(pte_factory, capfd):
    path = pte_factory(storage_dtype=torch.float32, initial_capacity=8)
    with configured(max_capacity=12):
        host = HostMethod(path)
    host.execute([prompt(10), positions(0, 10)])
    with pytest.raises(RuntimeError, match="token input 0: expected one int64 token id"):
        host.decode_greedy([prompt(2), positions(10, 2)], steps=3)
    with pytest.raises(RuntimeError, match="token_input 0 and position_input 0 must be two of the 2 inputs"):
        host.decode_greedy([prompt(1), positions(10, 1)], steps=3, position_input=0)
    with pytest.raises(RuntimeError, match="logits_output 1: the method has 1 outputs"):
        host.decode_greedy([prompt(1), positions(10, 1)], steps=3, logits_output=1)
    assert host.store.length == 10  # rejected before any step ran
    with pytest.raises(RuntimeError, match="executing 'forward' failed"):
        host.decode_greedy([prompt(1), positions(10, 1)], steps=10**12)  # the third step is past max_capacity
    assert "beyond max_capacity 12" in capfd.readouterr().err
    assert host.store.length == 12


def test_control_calls_from_another_thread_wait_for_the_step_instead_of_changing_the_store_under_it(pte_factory,
                                                                                                   tmp_path):
    import threading
    import time

    # decode_greedy releases the GIL for its whole loop: reset, rewind, save and
    # metrics from another thread used to land mid-step (reset crashed the step).
    path = pte_factory(storage_dtype=torch.float32, initial_capacity=8)
    host = HostMethod(path)
    store = rt.latest_store()
    stop, errors, rounds = threading.Event(), [], [0]

    def generate() -> None:
        while not stop.is_set():
            try:
                host.decode_greedy([torch.tensor([[1]]), positions(store.length, 1)], 40)
                rounds[0] += 1
            except Exception as e:  # noqa: BLE001 - any failure of a step is the test's failure
                errors.append(repr(e))
                return

    worker = threading.Thread(target=generate)
    worker.start()
    calls, end = 0, time.monotonic() + 3
    while time.monotonic() < end and worker.is_alive():
        store.reset(release_memory=calls % 2 == 0)
        store.metrics()
        try:
            store.rewind(1)
        except ValueError:
            pass  # nothing to rewind right after the reset
        store.save(str(tmp_path / "ctx.ogkv"))
        calls += 1
    stop.set()
    worker.join()
    assert not errors, errors
    assert rounds[0] > 0 and calls > 0
    # The store still works: a fresh start gives what a fresh method gives.
    store.reset()
    fresh = HostMethod(path)
    first = [m.execute([prompt(5), positions(0, 5)])[0] for m in (host, fresh)]
    assert torch.equal(first[0], first[1])
