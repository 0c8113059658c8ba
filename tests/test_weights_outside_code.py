"""Weights live outside the compiled code: named data of the .pte, mapped from the file at load.

The compiled .so holds kernels only; each weight is listed in the manifest and
checked at load against the compiled code's own table; a missing or
mismatched weight fails the load with its name; loading maps the file instead
of copying it, so RSS after load stays within the weight bytes.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import REPO, Oracle, Session, greedy, prompt, toy_model

from offgraph_kv.backend.aoti_compile import cpu_linear_kernel
from offgraph_kv.schemas import Manifest


def _manifest_span(data: bytes) -> "tuple[int, Manifest, bytes]":
    at = data.index(b"OGKV") - 4
    manifest = Manifest.from_bytes(data[at:])
    encoded = manifest.to_bytes()
    assert data[at:at + len(encoded)] == encoded, "manifest not found verbatim in the .pte"
    return at, manifest, encoded


def _elf_size(data: bytes, at: int) -> int:
    """Bytes of the ELF shared object starting at ``at``: its section headers come last."""
    shoff, = struct.unpack_from("<Q", data, at + 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, at + 0x3A)
    return shoff + shentsize * shnum


def _linear_weights(model: torch.nn.Module) -> "set[str]":
    return {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _largest_weight(model: torch.nn.Module) -> "tuple[str, bytes]":
    """The largest weight the .pte stores as the model holds it: with inductor's
    GEMM template (the CPU default) linear weights are stored packed for it."""
    packed = _linear_weights(model) if cpu_linear_kernel() == "cpp" else set()
    name, t = max(((n, p) for n, p in model.state_dict().items() if n not in packed), key=lambda e: e[1].numel())
    return name, t.contiguous().view(torch.uint8).numpy().tobytes()


def _load_error(path: Path, capfd: pytest.CaptureFixture) -> str:
    capfd.readouterr()
    with pytest.raises(RuntimeError):
        Session(path)
    return capfd.readouterr().err


def test_compiled_code_holds_no_weight_bytes(pte_factory, model):
    data = pte_factory(storage_dtype=torch.float32).read_bytes()
    _, m, _ = _manifest_span(data)
    assert m.version == 4
    params = dict(model.named_parameters())
    stored = {w.fqn.removeprefix("program.") for w in m.weights}
    if cpu_linear_kernel() == "cpp":
        # Every linear weight is stored packed (one constant of the template's own), the rest as they are.
        linear = _linear_weights(model)
        assert set(params) - linear <= stored and not stored & linear
        assert len(stored - set(params)) == len(linear)
    else:
        assert stored == set(params)
    so_at = data.index(b"\x7fELF")
    code = data[so_at:so_at + _elf_size(data, so_at)]
    _, weight = _largest_weight(model)
    assert weight not in code, "a weight's bytes are inside the compiled code"
    assert data.count(weight) == 1, "each weight is stored once, outside the code"
    weight_bytes = sum(p.numel() * 4 for p in params.values())
    stored_bytes = sum(w.nbytes for w in m.weights)
    assert stored_bytes <= 1.1 * weight_bytes  # packed weights: their 48-column blocks' padding at most
    # The file is the code plus the weights once (plus headers and alignment).
    assert len(data) < len(code) + stored_bytes + 64 * 1024


def test_weights_from_named_data_give_the_oracles_tokens(pte_factory, model):
    session = Session(pte_factory(storage_dtype=torch.float32))
    oracle = Oracle(model, torch.float32)
    tokens = prompt(7)
    out, ref = session.step(tokens), oracle.step(tokens)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    for _ in range(8):
        nxt = greedy(ref)
        out, ref = session.step(nxt), oracle.step(nxt)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def _edited(src: Path, dst: Path, edit) -> Path:
    data = bytearray(src.read_bytes())
    at, m, encoded = _manifest_span(bytes(data))
    new = edit(m).to_bytes()
    assert len(new) == len(encoded), "edit must keep the manifest's size"
    data[at:at + len(new)] = new
    dst.write_bytes(bytes(data))
    return dst


def _edit_weight(index: int, **changes: object):
    def edit(m: Manifest) -> Manifest:
        weights = list(m.weights)
        weights[index] = replace(weights[index], **changes)
        return replace(m, weights=weights)
    return edit


@pytest.mark.parametrize(
    "changes, expected",
    [
        (lambda w: {"data_key": w.data_key[:-4] + "dead"}, "is not in the program's named data"),
        (lambda w: {"dtype": 5}, "the manifest says dtype 5"),
        (lambda w: {"nbytes": w.nbytes + 4}, "the compiled code expects dtype 6, {nbytes} bytes"),
        (lambda w: {"name": w.name[:-1] + "X"}, "which the manifest does not list"),
        (lambda w: {"sizes": (w.sizes[0] + 1,) + tuple(w.sizes[1:])}, "its view reads element"),
    ],
    ids=["missing-data", "wrong-dtype", "wrong-size", "unknown-name", "view-outside-bytes"],
)
def test_bad_weight_entry_fails_the_load_naming_the_weight(pte_factory, tmp_path, capfd, changes, expected):
    src = pte_factory(storage_dtype=torch.float32)
    _, m, _ = _manifest_span(src.read_bytes())
    index = max(range(len(m.weights)), key=lambda i: m.weights[i].nbytes)
    w = m.weights[index]
    path = _edited(src, tmp_path / "bad.pte", _edit_weight(index, **changes(w)))
    err = _load_error(path, capfd)
    assert expected.format(nbytes=w.nbytes) in err
    assert w.fqn in err or w.name in err


def test_weight_whose_bytes_are_cut_short_fails_the_load(pte_factory, tmp_path, capfd):
    """The named data holds fewer bytes than the compiled code needs (a truncated entry)."""
    src = pte_factory(storage_dtype=torch.float32)
    _, m, _ = _manifest_span(src.read_bytes())
    small = min(m.weights, key=lambda w: w.nbytes)
    big = max(m.weights, key=lambda w: w.nbytes)
    assert small.data_key != big.data_key and len(small.data_key) == len(big.data_key)
    # Point the largest weight at the smallest one's bytes.
    index = m.weights.index(big)
    path = _edited(src, tmp_path / "short.pte", _edit_weight(index, data_key=small.data_key))
    err = _load_error(path, capfd)
    assert f"holds {small.nbytes} bytes, the compiled code expects {big.nbytes}" in err
    assert big.fqn in err


def test_flipped_byte_in_a_weight_fails_the_load_naming_it(pte_factory, model, tmp_path, capfd):
    src = pte_factory(storage_dtype=torch.float32)
    data = bytearray(src.read_bytes())
    _, m, _ = _manifest_span(bytes(data))
    name, weight = _largest_weight(model)
    at = bytes(data).index(weight)
    data[at + len(weight) // 2] ^= 0x10
    path = tmp_path / "flipped.pte"
    path.write_bytes(bytes(data))
    flipped = next(w for w in m.weights if w.fqn.removeprefix("program.") == name)
    err = _load_error(path, capfd)
    assert f"weights: '{flipped.fqn}': its bytes do not match their checksum" in err


_RSS_CHILD = r"""
import json, sys, time
import torch
import offgraph_kv.runtime
from executorch.runtime import Runtime

def rss():
    fields = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            fields[k] = int(v.split()[0]) * 1024
    return fields

path, width = sys.argv[1], int(sys.argv[2])
runtime = Runtime.get()
tokens = torch.zeros(1, width, dtype=torch.long)
positions = torch.arange(width, dtype=torch.long).unsqueeze(-1)  # model.positions(0, width)
before = rss()
t0 = time.perf_counter()
method = runtime.load_program(path).load_method("forward")
load_s = time.perf_counter() - t0
after_load = rss()
method.execute([tokens, positions])
after_step = rss()
store = offgraph_kv.runtime.stores()[-1].metrics()
print(json.dumps({"before": before, "after_load": after_load, "after_step": after_step, "load_s": load_s,
                  "kv_bytes": store["allocated_bytes"]}))
"""


def test_rss_after_load_stays_within_the_weight_bytes(medium_pte):
    path, weight_bytes = medium_pte
    assert weight_bytes > 100e6
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(path), "16"], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    fixed = 48 * 2**20  # the code's own mapping, the store, allocator slack
    bound = 1.1 * weight_bytes + r["kv_bytes"] + fixed
    added_at_load = r["after_load"]["VmRSS"] - r["before"]["VmRSS"]
    added_after_step = r["after_step"]["VmRSS"] - r["before"]["VmRSS"]
    assert added_at_load <= bound, r
    # The first step reads every weight: now they are resident, once.
    assert added_after_step <= bound, r
    # ... and they are file pages, not a private copy.
    anon_added = r["after_step"]["RssAnon"] - r["before"]["RssAnon"]
    assert anon_added < 0.25 * weight_bytes, r
