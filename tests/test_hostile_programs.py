"""Programs edited by someone else: a clear error, never a crash, a silent run or a leak.

Each edit is made to a real exported toy program; a case that could take the
process down runs in a child process, so a crash fails the test instead of the
suite.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import REPO, prompt
from test_bad_programs import _load_error, _manifest_span, _patched, _step_width_value_offset


@pytest.fixture(scope="module")
def src(pte_factory) -> Path:
    return pte_factory(storage_dtype=torch.bfloat16, initial_capacity=8)


def _run_child(code: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    script = "import sys; sys.path.insert(0, %r); sys.path.insert(0, %r)\n" % (str(REPO / "tests"), str(REPO / "examples" / "llama"))
    return subprocess.run([sys.executable, "-c", script + textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=timeout)


def _load_in_child(path: Path) -> subprocess.CompletedProcess:
    """Load `path` in a child: prints REJECTED for a clean refusal; a crash shows in the return code."""
    return _run_child("""
        import offgraph_kv.runtime
        try:
            offgraph_kv.runtime.load_method(sys.argv[1])
        except RuntimeError:
            print("REJECTED")
    """, str(path))


def test_a_non_utf8_byte_in_the_code_key_is_an_escaped_error_not_an_abort(src, tmp_path):
    data = src.read_bytes()
    at, m, encoded = _manifest_span(data)
    key_at = data.index(m.compiled_code_key.encode(), at)
    assert key_at < at + len(encoded)
    path = _patched(src, tmp_path / "key.pte", key_at + 15, b"\xff")
    child = _load_in_child(path)
    assert child.returncode == 0, child.stderr[-2000:]
    assert "REJECTED" in child.stdout
    assert "\\xff" in child.stderr and "is not in the program's named data" in child.stderr


def test_a_non_utf8_step_width_spec_is_an_escaped_error_not_an_abort(src, tmp_path):
    path = _patched(src, tmp_path / "spec.pte", _step_width_value_offset(src.read_bytes()), b"\xff:1")
    child = _load_in_child(path)
    assert child.returncode == 0, child.stderr[-2000:]
    assert "REJECTED" in child.stdout and "\\xff:1" in child.stderr


def test_a_flipped_byte_in_the_compiled_code_fails_the_load_naming_the_corruption(src, tmp_path, capfd):
    data = src.read_bytes()
    _, m, _ = _manifest_span(data)
    # The code is the largest blob of the file; flip a byte in its middle.
    elf = data.index(b"\x7fELF")
    path = _patched(src, tmp_path / "code.pte", elf + 200_000, bytes([data[elf + 200_000] ^ 0x10]))
    err = _load_error(path, capfd)
    assert "the program is corrupt" in err and m.compiled_code_key in err


@pytest.mark.parametrize("field, edit, named", [
    ("num_heads", lambda m: replace(m, tensors=[replace(t, num_heads=1) if i == 0 else t for i, t in enumerate(m.tensors)]),
     "tensor 0 (layer 0 K) is BFloat16 [1, *, 1, 16] at compiled input 2, the code takes BFloat16 [1, *, 2, 16]"),
    ("head_dim", lambda m: replace(m, tensors=[replace(t, head_dim=8) if i == 0 else t for i, t in enumerate(m.tensors)]),
     "the code takes BFloat16 [1, *, 2, 16]"),
    ("storage_dtype", lambda m: replace(m, tensors=[replace(t, storage_dtype=torch.float16) for t in m.tensors]),
     "tensor 0 (layer 0 K) is Half [1, *, 2, 16] at compiled input 2, the code takes BFloat16"),
    ("input_dtype", lambda m: replace(m, inputs=[replace(m.inputs[0], dtype=torch.int32), *m.inputs[1:]]),
     "delegate input 0: manifest says Int, the code takes Long"),
    ("width_bound", lambda m: replace(m, width_bound=64, max_write=64),
     "width_bound is 64, the code was compiled for 32"),
], ids=["num_heads", "head_dim", "storage_dtype", "input_dtype", "width_bound"])
def test_a_manifest_disagreeing_with_the_compiled_code_is_refused_at_load_naming_the_field(src, tmp_path, field, edit,
                                                                                           named):
    data = src.read_bytes()
    at, m, encoded = _manifest_span(data)
    new = edit(m).to_bytes()
    assert len(new) == len(encoded)
    path = _patched(src, tmp_path / f"{field}.pte", at, new)
    # AOTI's own per-step checks off: the load must refuse on its own.
    child = _run_child("""
        import os
        os.environ["OFFGRAPH_KV_AOTI_INPUT_CHECKS"] = "0"
        import offgraph_kv.runtime
        try:
            offgraph_kv.runtime.load_method(sys.argv[1])
            print("LOADED")
        except RuntimeError:
            print("REJECTED", offgraph_kv.runtime.last_error())
    """, str(path))
    assert child.returncode == 0, f"child died ({child.returncode}): {child.stderr[-2000:]}"
    assert child.stdout.startswith("REJECTED"), child.stdout
    assert "manifest does not match the compiled code" in child.stdout and named in child.stdout, child.stdout


def test_a_swapped_length_input_is_refused_at_load(pte_factory, tmp_path, capfd):
    from executorch.extension.llm.cache.reference_cache import LayerPolicy

    src = pte_factory(storage_dtype=torch.float32, initial_capacity=8,
                      layers=(LayerPolicy.ring(6), LayerPolicy.flat(), LayerPolicy.ring(16)), max_write=8)
    at, m, encoded = _manifest_span(src.read_bytes())
    first = m.tensors[0].compiled_input
    swapped = replace(m, length_input=first,
                      tensors=[replace(m.tensors[0], compiled_input=m.length_input), *m.tensors[1:]])
    new = swapped.to_bytes()
    assert len(new) == len(encoded)
    err = _load_error(_patched(src, tmp_path / "length.pte", at, new), capfd)
    assert "manifest does not match the compiled code" in err
    assert f"at compiled input {m.length_input}, the code takes Long [1] there" in err


@pytest.mark.parametrize("window", [2, 9])
def test_an_edited_ring_window_is_refused_at_load_naming_the_layer(pte_factory, tmp_path, capfd, window):
    # The code bakes each ring's band in; a manifest window it disagrees with
    # would size the ring's slots for another band (too few: keys still in the
    # window are overwritten; the logits go wrong with no error).
    from executorch.extension.llm.cache.reference_cache import LayerPolicy

    src = pte_factory(storage_dtype=torch.float32, initial_capacity=8,
                      layers=(LayerPolicy.ring(6), LayerPolicy.flat(), LayerPolicy.ring(16)), max_write=8)
    at, m, encoded = _manifest_span(src.read_bytes())
    edited = replace(m, tensors=[replace(t, window=window) if t.layer == 0 else t for t in m.tensors])
    new = edited.to_bytes()
    assert len(new) == len(encoded)
    err = _load_error(_patched(src, tmp_path / f"window{window}.pte", at, new), capfd)
    assert "manifest does not match the compiled code" in err
    assert f"layer 0 is a ring of window {window}, the code attends it as a ring of window 6" in err


def test_load_and_drop_cycles_leak_neither_memory_nor_mapped_code(src):
    child = _run_child("""
        import gc, os
        import torch
        from conftest import Session, prompt

        def rss_kib():
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) for l in f if l.startswith("VmRSS"))

        def mapped_code():
            with open("/proc/self/maps") as f:
                return sum(1 for l in f if "offgraph_kv_" in l and "(deleted)" in l)

        def cycle():
            s = Session(sys.argv[1])
            s.step(prompt(3))
            del s
            gc.collect()

        for _ in range(5):
            cycle()
        base, base_maps = rss_kib(), mapped_code()
        for _ in range(200):
            cycle()
        print(rss_kib() - base, base_maps, mapped_code(), os.path.getsize(sys.argv[1]))
    """, str(src))
    assert child.returncode == 0, child.stderr[-2000:]
    grown_kib, first_maps, maps, size = map(int, child.stdout.split())
    # The code is mapped once per process and reused by every later load (the old
    # leak mapped a new copy per load, about the code's size each).
    assert 0 < first_maps == maps, f"code mappings went from {first_maps} to {maps} over 200 load/drop cycles"
    assert grown_kib / 200 < 100, f"RSS grew {grown_kib} KiB over 200 load/step/drop cycles of a {size}-byte program"


def test_two_hundred_fuzzed_programs_never_crash_hang_or_run_with_other_logits(pte_factory, tmp_path):
    from fuzz_programs import failures, fuzz

    src = pte_factory(storage_dtype=torch.float32)
    # AOTI's own input checks off: the runtime's load-time checks hold alone.
    results = fuzz(src, seed=20261130, count=200, aoti_checks=False)
    summary = {k: dict(v) for k, v in results.items()}
    assert sum(sum(c.values()) for c in results.values()) == 200
    assert not failures(results), summary
    # Every corrupted compiled code is caught by the digest, before anything runs.
    for kind in ("code_bitflip", "code_byte"):
        assert set(results.get(kind, {})) <= {"load"}, summary


def test_host_method_refuses_a_wrong_number_of_inputs_instead_of_reusing_the_last_ones(src):
    from offgraph_kv.runtime import HostMethod

    method = HostMethod(src)
    method.execute([prompt(3), torch.arange(3).unsqueeze(-1)])
    with pytest.raises(RuntimeError, match="takes 2 inputs, got 1"):
        method.execute([prompt(1)])
