"""Rewind (undo, regenerate) and saved contexts (resume without re-prefill),
checked against the oracle fed exactly the history the store is left with."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import List, Sequence

import pytest
import torch
from conftest import REPO, Oracle, Session, greedy, load_configured, prompt
from executorch.extension.llm.cache.reference_cache import LayerPolicy
from test_ring_layers import MAX_WRITE, MIXED, _ring_pte

TOL = 1e-4
FLAT = [LayerPolicy.flat()]
BUDGET = 4


def _pte(pte_factory, layers: Sequence[LayerPolicy]) -> Path:
    return _ring_pte(pte_factory, layers)


def _chunked(step, ids: List[int]) -> torch.Tensor:
    """Feed ids in steps of at most MAX_WRITE; the last step's logits."""
    t = torch.tensor([ids])
    out = None
    for i in range(0, t.shape[1], MAX_WRITE):
        out = step(t[:, i:i + MAX_WRITE])
    return out


def _grow(session: Session, hist: List[int], n: int, oracle: "Oracle | None" = None) -> torch.Tensor:
    """n greedy steps after `hist` (whose logits are `session`'s last); appends to hist."""
    nxt = torch.tensor([[hist[-1]]])
    out = None
    for _ in range(n):
        out = session.step(nxt)
        if oracle is not None:
            torch.testing.assert_close(out, oracle.step(nxt), atol=TOL, rtol=TOL)
        nxt = greedy(out)
        hist.append(int(nxt))
    return out


def _start(pte: Path, n_generated: int) -> "tuple[Session, List[int]]":
    session = load_configured(pte, rewind_budget=BUDGET)
    hist = prompt(10)[0].tolist()
    hist.append(int(greedy(_chunked(session.step, hist))))
    _grow(session, hist, n_generated)
    # hist holds every fed token plus the next one to feed.
    return session, hist


@pytest.mark.parametrize("layers", [FLAT, MIXED], ids=["flat", "mixed-flat-ring"])
def test_rewind_then_regenerate_equals_the_oracle_from_the_rewound_history(pte_factory, model, layers):
    # 28 steps after a 10-token prefill: flat storage grows 8 -> 16 -> 32 -> 64;
    # ring(6) with the budget has 6 + 8 - 1 + 4 = 17 slots and wraps twice.
    session, hist = _start(_pte(pte_factory, layers), 28)
    assert session.store.length == 38 and session.store.metrics()["growths"] >= 2
    # max_write + budget = 12 is what a ring allows after any step; back over a growth boundary and a wrap.
    for n in (12, 5, 1):
        session.store.rewind(n)
        session.length -= n
        del hist[-n - 1:]  # the rewound tokens and the pending next one
        assert session.store.length == len(hist)
        oracle = Oracle(model, torch.float32, layers=layers)
        _chunked(oracle.step, hist)
        hist.append(7)  # regenerate from another token than the one that followed
        _grow(session, hist, 6, oracle)


def test_truncate_and_can_extend(pte_factory):
    session, hist = _start(_pte(pte_factory, FLAT), 6)
    store = session.store
    store.truncate(10)
    assert store.length == 10
    with pytest.raises(ValueError, match="holds only 10"):
        store.truncate(11)
    assert store.can_extend(4086) and not store.can_extend(1 << 30)
    assert not store.can_extend(2**64 - 1) and not store.can_extend(2**64 - 8)  # no wrap past max_capacity


def test_rewind_beyond_what_a_ring_keeps_is_refused_naming_the_budget_and_changes_nothing(pte_factory, model):
    session, hist = _start(_pte(pte_factory, MIXED), 28)
    before = session.store.metrics()
    with pytest.raises(ValueError, match=rf"ring layer 0 \(window 6\).*at most {MAX_WRITE + BUDGET} positions now; "
                                         rf"rewind_budget {BUDGET}"):
        session.store.rewind(MAX_WRITE + BUDGET + 1)
    assert session.store.metrics() == before
    with pytest.raises(ValueError, match="the store holds 38"):
        session.store.rewind(39)
    oracle = Oracle(model, torch.float32, layers=MIXED)
    _chunked(oracle.step, hist[:-1])
    _grow(session, hist, 3, oracle)


# --------------------------------------------------------------------------- #
# Saved contexts
# --------------------------------------------------------------------------- #

_RESUME = """
import sys, json, torch
from conftest import load_configured, greedy
session = load_configured(sys.argv[1], rewind_budget=%d)
session.store.load(sys.argv[2])
session.length = session.store.length
nxt = torch.tensor([[int(sys.argv[3])]])
out = []
for _ in range(8):
    logits = session.step(nxt)
    out.append(logits[0, -1].tolist())
    nxt = greedy(logits)
print(json.dumps(out))
""" % BUDGET


@pytest.mark.parametrize("layers", [FLAT, MIXED], ids=["flat", "mixed-flat-ring"])
def test_save_then_load_in_a_new_process_continues_like_the_uninterrupted_run(pte_factory, tmp_path, layers):
    pte = _pte(pte_factory, layers)
    session, hist = _start(pte, 20)
    path = tmp_path / "ctx.ogkv"
    session.store.save(str(path))
    assert not Path(str(path) + ".tmp").exists()
    # Only committed rows: at most length rows per layer (rings keep fewer), no capacity padding.
    m = session.store.metrics()
    per_token = sum(l["bytes"] // l["rows"] for l in m["layers"])
    flat_part = sum(l["bytes"] // l["rows"] for l in m["layers"] if l["kind"] == "flat") * m["length"]
    assert flat_part < path.stat().st_size <= m["length"] * per_token + 1024
    assert m["capacity"] > m["length"]  # so padding would have shown
    want = []
    nxt = torch.tensor([[hist[-1]]])
    for _ in range(8):
        logits = session.step(nxt)
        want.append(logits[0, -1])
        nxt = greedy(logits)
    child = subprocess.run([sys.executable, "-c", "import sys; sys.path[:0] = [%r, %r]\n" % (
        str(REPO / "tests"), str(REPO / "examples" / "llama")) + _RESUME, str(pte), str(path), str(hist[-1])],
        capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    import json

    got = torch.tensor(json.loads(child.stdout.strip().splitlines()[-1]))
    torch.testing.assert_close(got, torch.stack(want), atol=TOL, rtol=TOL)


def _each_refused(store: object, tmp_path: Path, cases: "dict[str, tuple[bytes, str]]") -> None:
    """Each case's bytes, written to a file, are refused by ``store.load`` with its message; the store stays empty."""
    for name, (blob, message) in cases.items():
        path = tmp_path / f"{name}.ogkv"
        path.write_bytes(blob)
        with pytest.raises(ValueError, match=message):
            store.load(str(path))
        assert store.length == 0, name


def test_a_saved_context_from_another_program_or_damaged_is_refused_and_the_store_stays_usable(pte_factory, tmp_path):
    session, hist = _start(_pte(pte_factory, FLAT), 6)
    good = tmp_path / "good.ogkv"
    session.store.save(str(good))
    data = good.read_bytes()
    cases = {
        "truncated": (data[: len(data) // 2], "truncated or corrupt"),
        "flipped": (data[:100] + bytes([data[100] ^ 1]) + data[101:], "truncated or corrupt"),
        "flipped in the rows": (data[:-40] + bytes([data[-40] ^ 0x80]) + data[-39:], "truncated or corrupt"),
        "block count changed": (data[:-4] + (int.from_bytes(data[-4:], "little") + 1).to_bytes(4, "little"),
                                "truncated or corrupt"),
        "a byte appended": (data + b"\0", "truncated or corrupt"),
        "foreign": (b"GGUF" + data[4:], "not an offgraph-kv saved context"),
    }
    other = load_configured(_pte(pte_factory, MIXED), rewind_budget=BUDGET)
    with pytest.raises(ValueError, match="saved by another program"):
        other.store.load(str(good))
    fresh = load_configured(_pte(pte_factory, FLAT), rewind_budget=BUDGET)
    _each_refused(fresh.store, tmp_path, cases)
    with pytest.raises(ValueError, match="not a regular file"):
        fresh.store.load(str(tmp_path))  # a directory
    assert fresh.store.length == 0
    with pytest.raises(ValueError, match="not a regular file"):
        session.store.save(str(tmp_path))  # never renamed onto a directory or a device
    with pytest.raises(ValueError, match="empty store"):
        session.store.load(str(good))
    fresh.store.load(str(good))
    assert fresh.store.length == session.store.length
    fresh.length = fresh.store.length
    fresh.step(torch.tensor([[hist[-1]]]))


def _resealed(body: bytes) -> bytes:
    """A saved context's body with fresh block CRCs (what a crafted file carries): only the reader's own checks
    stand between it and the store."""
    import zlib

    block = 4 << 20
    crcs = [zlib.crc32(body[i:i + block]) for i in range(0, len(body), block)]
    return body + b"".join(c.to_bytes(4, "little") for c in crcs) + len(crcs).to_bytes(4, "little")


def test_a_crafted_ring_span_with_valid_checksums_is_refused_naming_the_tensor(pte_factory, tmp_path):
    session, hist = _start(_pte(pte_factory, MIXED), 12)
    good = tmp_path / "good.ogkv"
    session.store.save(str(good))
    data = good.read_bytes()
    blocks = int.from_bytes(data[-4:], "little")
    body = bytearray(data[: len(data) - 4 - 4 * blocks])
    id_len = int.from_bytes(body[12:16], "little")
    at = 16 + id_len
    length, count = int.from_bytes(body[at:at + 8], "little"), int.from_bytes(body[at + 8:at + 12], "little")
    spans = [at + 12 + 24 * i for i in range(count)]
    ring = next(i for i in range(count) if int.from_bytes(body[spans[i]:spans[i] + 8], "little") > 0)

    def with_span(first: int, rows: int) -> bytes:
        b = bytearray(body)
        b[spans[ring]:spans[ring] + 16] = first.to_bytes(8, "little") + rows.to_bytes(8, "little")
        return _resealed(bytes(b))

    assert _resealed(bytes(body)) == data  # the test's resealing is the store's own
    cases = {
        # first past the length: first + rows wraps to the length in 64 bits.
        "first past the length": (with_span(length + 2**57, 2**64 - 2**57), "does not match this program's"),
        "too few rows for the window": (with_span(length - 1, 1), f"tensor {ring} \\(ring layer"),
    }
    fresh = load_configured(_pte(pte_factory, MIXED), rewind_budget=BUDGET)
    _each_refused(fresh.store, tmp_path, cases)
    fresh.store.load(str(good))
    assert fresh.store.length == length
