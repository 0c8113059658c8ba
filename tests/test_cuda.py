"""The same pipeline on CUDA: KV in device memory, AOTI compiled for the GPU.

Skips cleanly without a CUDA device (CI has none); results from the H200 are
recorded under benchmarks/results/.
"""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import (MEDIUM, TOY, Oracle, Session, configured, generate_checked, greedy, load_configured, lower, positions,
                      prompt)
from model import Transformer, init_deterministic

import offgraph_kv.runtime
from offgraph_kv.runtime import HostMethod
from executorch.extension.llm.cache.reference_cache import LayerPolicy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}
MIXED = (LayerPolicy.ring(6), LayerPolicy.flat(), LayerPolicy.ring(16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_cuda_generation_across_growth_boundaries_matches_oracle(pte_factory, model, dtype):
    session = Session(pte_factory(device="cuda", storage_dtype=dtype, initial_capacity=8))
    oracle = Oracle(model, dtype)
    caps = {session.store.capacity}
    tokens = prompt(11)
    for chunk in (tokens[:, :5], tokens[:, 5:11]):
        got, want = session.step(chunk), oracle.step(chunk)
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    nxt = greedy(got)
    agree = 0
    for _ in range(60):
        ref = greedy(want)
        agree += int(torch.equal(nxt, ref))
        got, want = session.step(nxt), oracle.step(nxt)  # both fed our token: compare step by step
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
        nxt = greedy(got)
        caps.add(session.store.capacity)
    assert sorted(caps) == [8, 16, 32, 64, 128]
    if dtype == torch.float32:
        assert agree == 60, "fp32 storage must give identical greedy tokens"
    m = session.store.metrics()
    assert m["length"] == 71 and m["growths"] == 4


def test_cuda_ring_wrap_matches_oracle(pte_factory, model):
    layers = (LayerPolicy.ring(6), LayerPolicy.flat(), LayerPolicy.ring(16))
    session = Session(pte_factory(device="cuda", storage_dtype=torch.float32, initial_capacity=8,
                                  layers=layers, max_write=8))
    oracle = Oracle(model, torch.float32, layers=layers)
    tokens = prompt(20, seed=4)
    for start in range(0, 20, 8):
        chunk = tokens[:, start:start + 8]
        torch.testing.assert_close(session.step(chunk), oracle.step(chunk), atol=1e-3, rtol=1e-3)
    nxt = greedy(oracle.step(prompt(1)))
    session.step(prompt(1))
    for _ in range(3 * 23):
        got, want = session.step(nxt), oracle.step(nxt)
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
        nxt = greedy(want)
    assert [l["bytes"] for l in session.store.metrics()["layers"]][0] == 13 * TOY.n_kv_heads * TOY.head_dim * 4 * 2


def test_cuda_rejected_step_changes_nothing(pte_factory, capfd):
    path = pte_factory(device="cuda", storage_dtype=torch.bfloat16, initial_capacity=8)
    session = load_configured(path, max_capacity=16)
    session.step(prompt(12))
    with pytest.raises(RuntimeError):
        session.method.execute([prompt(5), torch.arange(12, 17).unsqueeze(-1)])
    assert "beyond max_capacity 16" in capfd.readouterr().err
    assert session.store.length == 12
    session.step(prompt(4))
    assert session.store.length == 16


def test_cuda_growth_copy_runs_at_memcpy_speed():
    bench = pytest.importorskip("offgraph_kv.runtime._bench", reason="built without -DOFFGRAPH_KV_BENCHMARKS=ON")

    t = bench.time_growth("cuda", 8, 8, 128, "bf16", 16384, 32768, 3, "auto")
    src = torch.empty(t["bytes_copied"], dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        dst.copy_(src)
    end.record()
    end.synchronize()
    memcpy = start.elapsed_time(end) / 5 / 1e3
    # A gross-regression guard (a per-row or per-layer fallback is several times
    # slower); the bandwidth itself is benchmarks/cuda/growth.py's to report.
    assert t["copy_device_seconds"] < 2 * memcpy, (t, memcpy)


def test_cuda_rewind_and_saved_context_continue_like_the_oracle(pte_factory, model, tmp_path):
    layers = (LayerPolicy.ring(6), LayerPolicy.flat(), LayerPolicy.ring(16))
    path = pte_factory(device="cuda", storage_dtype=torch.float32, initial_capacity=8, layers=layers, max_write=8)
    session = load_configured(path, rewind_budget=4)
    hist = prompt(30, seed=5)[0].tolist()
    for start in range(0, 30, 8):
        session.step(torch.tensor([hist[start:start + 8]]))
    # Back 12 (max_write + budget) over a growth and a ring wrap, then on like a fresh oracle fed what is kept.
    session.store.rewind(12)
    session.length -= 12
    kept = hist[:18]
    saved = tmp_path / "ctx.ogkv"
    session.store.save(str(saved))
    resumed = load_configured(path, rewind_budget=4)
    resumed.store.load(str(saved))
    resumed.length = resumed.store.length
    oracle = Oracle(model, torch.float32, layers=layers)
    for start in range(0, 18, 8):
        oracle.step(torch.tensor([kept[start:start + 8]]))
    nxt = prompt(1, seed=6)
    for _ in range(20):
        want = oracle.step(nxt)
        torch.testing.assert_close(session.step(nxt), want, atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(resumed.step(nxt), want, atol=1e-3, rtol=1e-3)
        nxt = greedy(want)


def _generate(session: Session, oracle: Oracle) -> "tuple[list, list]":
    return generate_checked(session, oracle, ((0, 5), (5, 11)), 1e-3)


def test_cuda_map_growth_matches_oracle_and_copy_growth_at_fixed_addresses(pte_factory, model):
    path = pte_factory(device="cuda", storage_dtype=torch.float32, initial_capacity=8)
    mapped = load_configured(path, growth="map")
    copied = load_configured(path, growth="copy")
    m = mapped.store.metrics()
    assert m["growth"] == "map", m["growth_note"]
    assert copied.store.metrics()["growth"] == "copy"
    got_map, addr_map = _generate(mapped, Oracle(model, torch.float32))
    got_copy, addr_copy = _generate(copied, Oracle(model, torch.float32))
    for a, b in zip(got_map, got_copy):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    m, c = mapped.store.metrics(), copied.store.metrics()
    assert (m["length"], m["capacity"], m["growths"]) == (c["length"], c["capacity"], c["growths"]) == (71, 128, 4)
    assert all(a == addr_map[0] for a in addr_map), "map growth moved a tensor"
    assert any(a != addr_copy[0] for a in addr_copy)
    assert m["peak_bytes"] == m["allocated_bytes"] and c["peak_bytes"] > c["allocated_bytes"]


def test_cuda_map_growth_backs_chunks_as_it_grows_and_reset_releases_them(pte_factory):
    path = pte_factory(device="cuda", storage_dtype=torch.float32, initial_capacity=8)
    session = load_configured(path, growth="map", max_capacity=1 << 16)
    store = session.store
    at_load, initial = store.addresses(), store.metrics()["allocated_bytes"]
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    # fp32 rows of 2 x 16: 128 B, so 40000 rows need 3 chunks of 2 MiB per tensor.
    for _ in range(40000 // 32):
        session.step(prompt(32))
    m = store.metrics()
    assert m["capacity"] == 65536 and store.addresses() == at_load
    grown = m["allocated_bytes"]
    assert grown > initial and m["peak_bytes"] == grown
    torch.cuda.synchronize()
    free1 = torch.cuda.mem_get_info()[0]
    store.reset(release_memory=True)
    session.length = 0
    torch.cuda.synchronize()
    free2 = torch.cuda.mem_get_info()[0]
    m = store.metrics()
    assert (m["capacity"], m["allocated_bytes"]) == (8, initial) and store.addresses() == at_load
    # The device got the chunks back (torch's allocator may hold a little of what the steps used in between).
    assert free2 - free1 >= grown - initial - (2 << 20), (free0, free1, free2, grown, initial)
    session.step(prompt(5))  # grows again from the initial chunk, at the same addresses
    assert store.addresses() == at_load


def test_cuda_million_row_reservation_for_an_8b_shaped_store_costs_no_device_memory():
    bench = pytest.importorskip("offgraph_kv.runtime._bench", reason="built without -DOFFGRAPH_KV_BENCHMARKS=ON")
    # 32 layers, 8 KV heads x 128, bf16, K and V: 128 GiB for 1M rows.
    c = bench.reservation_cost("cuda", 32, 8, 128, "bf16", 256, 1 << 20)
    assert c["growth"] == "map", c["note"]
    assert c["reserved_bytes"] >= 32 * 2 * (1 << 20) * 8 * 128 * 2
    # Only the initial rows are backed (one chunk per tensor); the reservation itself takes nothing.
    assert c["allocated_bytes"] <= 64 * (2 << 20)
    assert c["device_used_delta"] <= c["allocated_bytes"], c


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_kernels_mixed_ring_and_flat_layers_match_oracle(model, dtype, tmp_path, monkeypatch):
    # 16-bit storage on CUDA attends through our Triton kernels (the default; one
    # op per layer: write at the length read from device memory, then attend):
    # rings of 6 and 16 beside a flat layer; a 40-token prompt chunk (80 folded
    # query rows: the wide kernel variant), then chunks that straddle wraps and growths.
    monkeypatch.setenv("OFFGRAPH_KV_CUDA_ATTENTION", "triton")
    layers = MIXED
    path = tmp_path / "kernels.pte"
    path.write_bytes(lower(model, 40, device="cuda", storage_dtype=dtype, initial_capacity=8, layers=layers,
                           max_write=40))
    assert b"_update_attend_partial" in path.read_bytes(), "the program does not embed the Triton kernels"
    session = Session(path)
    oracle = Oracle(model, dtype, layers=layers)
    tokens = prompt(61, seed=4)
    for start, end in ((0, 40), (40, 48), (48, 56), (56, 61)):
        chunk = tokens[:, start:end]
        torch.testing.assert_close(session.step(chunk), oracle.step(chunk), atol=TOL[dtype], rtol=TOL[dtype])
    nxt = prompt(1, seed=9)
    for _ in range(40):
        got, want = session.step(nxt), oracle.step(nxt)
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
        nxt = greedy(want)
    assert session.store.length == 101


@pytest.mark.parametrize("growth", ["map", "copy"])
def test_cuda_decode_graph_replays_give_the_uncaptured_logits_bit_for_bit(pte_factory, model, growth):
    # 16-bit storage attends through our kernels, which read the length from
    # device memory: decode steps are captured once and replayed. Across ring
    # wraps, growths (copy growth moves the storage: a new capture), a rewind
    # and a wider step between decode steps, every replay must give exactly the
    # uncaptured step's logits, and both the oracle's.
    path = pte_factory(device="cuda", storage_dtype=torch.bfloat16, initial_capacity=8, layers=MIXED, max_write=8)
    graphed = load_configured(path, growth=growth)
    plain = load_configured(path, growth=growth, cuda_graphs=False)
    oracle = Oracle(model, torch.bfloat16, layers=MIXED)
    tokens = prompt(13, seed=5)
    for chunk in (tokens[:, :8], tokens[:, 8:]):
        torch.testing.assert_close(graphed.step(chunk), plain.step(chunk), atol=0, rtol=0)
        want = oracle.step(chunk)
    nxt, decode_steps = greedy(want), 0
    for i in range(70):  # lengths 13 -> 83: flat capacity 16 -> 32 -> 64 -> 128, rings wrap many times
        if i == 30:  # a 3-token step between decode steps runs uncaptured; decoding replays again after it
            chunk = prompt(3, seed=11)
            torch.testing.assert_close(graphed.step(chunk), plain.step(chunk), atol=0, rtol=0)
            want = oracle.step(chunk)
            nxt = greedy(want)
        got, ref = graphed.step(nxt), plain.step(nxt)
        decode_steps += 1
        assert torch.equal(got, ref), f"decode step {i}: the replayed graph's logits differ from the uncaptured step's"
        want = oracle.step(nxt)
        torch.testing.assert_close(got, want, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
        nxt = greedy(want)
    g, p = graphed.store.metrics(), plain.store.metrics()
    assert (p["graph_captures"], p["graph_replays"]) == (0, 0)
    assert g["growth"] == growth and g["length"] == p["length"] == 86
    assert g["graph_replays"] == decode_steps - 1  # all but the first decode step
    # Map growth never moves the storage: one capture for the whole run. Copy
    # growth moves it at 17, 33 and 65 tokens, each after the first capture.
    assert g["graph_captures"] == (1 if growth == "map" else 4), g


def test_cuda_cpp_greedy_loop_replays_the_graph_and_gives_the_python_loops_tokens(pte_factory):
    # HostMethod.decode_greedy: the decode loop in C++ (ExecuTorch's C++ runner's
    # way), each step the same captured graph the Python loop replays.
    path = pte_factory(device="cuda", storage_dtype=torch.bfloat16, initial_capacity=8, layers=MIXED, max_write=8)
    with configured(growth="map"):
        python_loop, cpp_loop = HostMethod(path), HostMethod(path)
    first = [greedy(m.execute([prompt(8, seed=5), positions(0, 8)])[0]) for m in (python_loop, cpp_loop)][0]
    want, tok = [], first
    for i in range(40):  # flat storage grows 8 -> 16 -> 32 -> 64 under both loops
        tok = greedy(python_loop.execute([tok, positions(8 + i, 1)])[0])
        want.append(int(tok))
    got, _ = cpp_loop.decode_greedy([first, positions(8, 1)], steps=40)
    assert got == want
    m = cpp_loop.store.metrics()
    assert (m["graph_captures"], m["graph_replays"], m["length"]) == (1, 39, 48), m


def test_cuda_decode_graph_survives_rewind_and_a_rejected_step(pte_factory, model):
    # The length is an input in device memory, so a rewind replays the same
    # graph; a step past max_capacity is refused before anything replays.
    path = pte_factory(device="cuda", storage_dtype=torch.bfloat16, initial_capacity=8, layers=MIXED, max_write=8)
    session = load_configured(path, max_capacity=40)
    tokens = prompt(40, seed=6)
    session.step(tokens[:, :8])
    for j in range(8, 30):  # decode steps: captured from the second on
        session.step(tokens[:, j:j + 1])
    before = session.store.metrics()
    assert before["graph_captures"] == 1 and before["graph_replays"] == 21
    session.store.rewind(6)
    session.length -= 6
    oracle = Oracle(model, torch.bfloat16, layers=MIXED)
    for start in range(0, 24, 8):
        oracle.step(tokens[:, start:start + 8])
    for j in range(24, 40):
        got, want = session.step(tokens[:, j:j + 1]), oracle.step(tokens[:, j:j + 1])
        torch.testing.assert_close(got, want, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
    with pytest.raises(RuntimeError):
        session.method.execute([tokens[:, :1], positions(40, 1)])
    assert session.store.length == 40
    session.store.rewind(1)
    session.length -= 1
    oracle.reset()
    for start in range(0, 39, 8):
        oracle.step(tokens[:, start:min(start + 8, 39)])
    torch.testing.assert_close(session.step(tokens[:, 39:40]), oracle.step(tokens[:, 39:40]),
                               atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
    m = session.store.metrics()
    assert m["graph_captures"] == 1 and m["graph_replays"] == before["graph_replays"] + 17


@pytest.fixture(scope="module")
def medium_cuda_pte(tmp_path_factory: pytest.TempPathFactory) -> "tuple[object, int]":
    """The ~135 MB MEDIUM model compiled for CUDA (its weights stand out in device memory)."""
    model = init_deterministic(Transformer(MEDIUM), seed=3).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    path = tmp_path_factory.mktemp("medium_cuda") / "medium_cuda.pte"
    path.write_bytes(lower(model, device="cuda", storage_dtype=torch.bfloat16, initial_capacity=256))
    return path, weight_bytes


def _device_used() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_cuda_sessions_hold_the_weights_once_and_interleave_like_each_alone(medium_cuda_pte):
    path, weight_bytes = medium_cuda_pte
    gc.collect()
    width = 16
    tokens = [prompt(width, seed=20 + i) % MEDIUM.vocab_size for i in range(4)]

    def run(method, i):  # a 16-token prefill, then 8 greedy steps
        outs = [method.execute([tokens[i], positions(0, width)])[0].clone()]
        for k in range(8):
            outs.append(method.execute([greedy(outs[-1]), positions(width + k, 1)])[0].clone())
        return outs

    alone = []
    for i in range(4):
        alone.append(run(offgraph_kv.runtime.load_method(path), i))  # either route, like Sessions
        gc.collect()
    before = _device_used()
    sessions = offgraph_kv.runtime.Sessions(path, 1)
    first = sessions[0]
    first.execute([tokens[0], positions(0, width)])  # allocates the KV and the step's workspace
    first.store.reset()
    after_one = _device_used()
    for _ in range(3):
        s = sessions.add()
        s.execute([tokens[0], positions(0, width)])
        s.store.reset()
    after_four = _device_used()
    shared = [e for e in offgraph_kv.runtime.shared_weights() if e["sessions"] == 4]
    assert len(shared) == 1 and shared[0]["on_device"], offgraph_kv.runtime.shared_weights()
    assert after_one - before >= 0.9 * weight_bytes  # the weights are on the device, once
    kv = sum(s.store.metrics()["allocated_bytes"] for s in list(sessions)[1:])
    added = after_four - after_one
    # Three more sessions: their KV plus a container and a stream each; three
    # more copies of the weights would be 3 x 133 MB.
    assert added <= kv + 3 * 32 * 2**20, (added, kv, weight_bytes)
    # Interleaved step by step: each gives exactly what it gave alone.
    for s in sessions:
        s.store.reset()
    runs = [[] for _ in range(4)]
    for i, s in enumerate(sessions):
        runs[i].append(s.execute([tokens[i], positions(0, width)])[0].clone())
    for k in range(8):
        for i, s in enumerate(sessions):
            runs[i].append(s.execute([greedy(runs[i][-1]), positions(width + k, 1)])[0].clone())
    for i in range(4):
        assert all(torch.equal(a, b) for a, b in zip(runs[i], alone[i])), f"session {i}"
    del sessions, first, s
    gc.collect()
    assert not [e for e in offgraph_kv.runtime.shared_weights() if e["on_device"]]
