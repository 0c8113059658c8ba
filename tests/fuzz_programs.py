"""Reproducible fuzzing of a .pte: mutants of the manifest, the compiled code and
ExecuTorch's own program, each loaded and stepped, none allowed to crash, hang or
run with different logits.

    python tests/fuzz_programs.py PROGRAM.pte --seed 0 --count 300

A worker process loads mutants one after another (importing torch once); when a
mutant kills it, the parent records a crash and starts a new worker at the next
mutant, so one run covers hundreds of mutants in a minute or two. Each mutant
ends in one class:

- ``load``: rejected at load; ``step``: loaded, its step rejected;
- ``same``: ran with the clean program's logits (the mutation changed nothing that matters);
- ``different``: ran with other logits (a failure, unless the mutation is in
  ExecuTorch's own FlatBuffer, listed apart as ``executorch_*``);
- ``crash`` / ``hang``: the worker died or timed out (a failure, same exception).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent

Mutant = Tuple[str, List[Tuple[int, bytes]]]  # (kind, [(offset, new bytes)])


def _manifest_span(data: bytes) -> Tuple[int, int]:
    from offgraph_kv.schemas import Manifest

    at = data.index(b"OGKV") - 4
    return at, len(Manifest.from_bytes(data[at:]).to_bytes())


def _code_span(data: bytes) -> Tuple[int, int]:
    start = data.index(b"\x7fELF")
    return start, len(data) - start  # the code is the last and largest segment


def _reencodings(data: bytes, at: int, size: int, rng: random.Random) -> Optional[List[Tuple[int, bytes]]]:
    """One manifest field (or one private tensor's field) set to another value of
    the same encoded size, so the rest of the file stays where it was."""
    from offgraph_kv.schemas import Manifest

    m = Manifest.from_bytes(data[at:])
    ints = lambda: rng.choice([0, 1, 2, 3, 7, 8, 64, 255, 2**16, 2**31 - 1, 2**32 - 1])  # noqa: E731
    if rng.random() < 0.5 and m.tensors:
        i = rng.randrange(len(m.tensors))
        name = rng.choice(["num_heads", "head_dim", "compiled_input", "window", "layer"])
        tensors = list(m.tensors)
        tensors[i] = replace(tensors[i], **{name: ints()})
        new = replace(m, tensors=tensors)
    else:
        name = rng.choice(["num_user_inputs", "num_outputs", "max_write", "capacity_bound", "initial_capacity",
                           "max_capacity", "length_input", "width_bound"])
        value = ints() if name != "capacity_bound" else rng.choice([1, 2**40, 2**63 - 1, 5])
        new = replace(m, **{name: value})
    try:
        encoded = new.to_bytes()
    except Exception:  # a value the writer's types cannot hold
        return None
    return [(at, encoded)] if len(encoded) == size else None


def make_mutants(data: bytes, seed: int, count: int) -> List[Mutant]:
    rng = random.Random(seed)
    m_at, m_size = _manifest_span(data)
    c_at, c_size = _code_span(data)
    out: List[Mutant] = []
    while len(out) < count:
        kind = rng.choice(["manifest_bitflip", "manifest_byte", "manifest_reencode", "code_bitflip", "code_byte",
                           "executorch_bitflip", "executorch_header"])
        if kind == "manifest_bitflip":
            o = m_at + rng.randrange(m_size)
            edits = [(o, bytes([data[o] ^ (1 << rng.randrange(8))]))]
        elif kind == "manifest_byte":
            o = m_at + rng.randrange(m_size)
            edits = [(o, bytes([rng.choice([0x00, 0x7f, 0x80, 0xff, rng.randrange(256)])]))]
        elif kind == "manifest_reencode":
            edits = _reencodings(data, m_at, m_size, rng)
            if edits is None:
                continue
        elif kind in ("code_bitflip", "code_byte"):
            o = c_at + rng.randrange(c_size)
            new = data[o] ^ (1 << rng.randrange(8)) if kind == "code_bitflip" else (data[o] + rng.randrange(1, 256)) % 256
            edits = [(o, bytes([new]))]
        elif kind == "executorch_header":
            o = rng.randrange(64)
            edits = [(o, bytes([rng.randrange(256)]))]
        else:  # ExecuTorch's program FlatBuffer: everything before the manifest
            o = rng.randrange(m_at)
            edits = [(o, bytes([data[o] ^ (1 << rng.randrange(8))]))]
        out.append((kind, edits))
    return out


# --------------------------------------------------------------------------- #
# Worker: loads mutants named on stdin, prints one result line each
# --------------------------------------------------------------------------- #

_WORKER = r"""
import sys, json, torch
sys.path.insert(0, %(tests)r); sys.path.insert(0, %(examples)r)
import offgraph_kv.runtime
from model import positions
src = open(sys.argv[1], "rb").read()
work = sys.argv[2]
tokens = torch.tensor([[3, 1, 4]])
def run(path):
    m = offgraph_kv.runtime.load_method(path)
    return m, m.execute([tokens, positions(0, 3)])[0]
# No method stays loaded between mutants: a live session of the same program
# would lend its checked weights to the next load (sessions share them), and
# the mutant's own weight bytes would go unchecked.
clean = run(sys.argv[1])[1]
m = None
print("READY", flush=True)
for line in sys.stdin:
    m = None
    edits = json.loads(line)
    data = bytearray(src)
    for at, hexbytes in edits:
        new = bytes.fromhex(hexbytes)
        data[at:at + len(new)] = new
    open(work, "wb").write(bytes(data))
    try:
        m = offgraph_kv.runtime.load_method(work)
    except Exception:
        print("load", flush=True); continue
    try:
        out = m.execute([tokens, positions(0, 3)])[0]
    except Exception:
        print("step", flush=True); continue
    same = out.shape == clean.shape and torch.equal(out, clean)
    print("same" if same else "different", flush=True)
    del m
"""


def fuzz(pte: Path, seed: int, count: int, timeout: float = 60.0, aoti_checks: bool = True) -> Dict[str, Counter]:
    """Run ``count`` mutants of ``pte``; results counted per mutant kind. With
    ``aoti_checks=False`` AOTInductor's own per-run input checks are off, so
    only the runtime's own checks stand between a mutant and the heap."""
    import os

    env = dict(os.environ, OFFGRAPH_KV_AOTI_INPUT_CHECKS="1" if aoti_checks else "0")
    data = pte.read_bytes()
    mutants = make_mutants(data, seed, count)
    results: Dict[str, Counter] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = str(Path(tmp) / "mutant.pte")
        code = _WORKER % {"tests": str(HERE), "examples": str(HERE.parent / "examples" / "llama")}
        i = 0
        while i < len(mutants):
            worker = subprocess.Popen([sys.executable, "-c", code, str(pte), work], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
            assert worker.stdout.readline().strip() == "READY", "the clean program did not run"
            try:
                while i < len(mutants):
                    kind, edits = mutants[i]
                    worker.stdin.write(json.dumps([(o, b.hex()) for o, b in edits]) + "\n")
                    worker.stdin.flush()
                    line = _readline(worker, timeout)
                    outcome = line.strip() if line else ("hang" if line is None else "crash")
                    results.setdefault(kind, Counter())[outcome] += 1
                    i += 1
                    if outcome in ("crash", "hang"):
                        break
            finally:
                worker.kill()
                worker.wait()
    return results


def _readline(proc: subprocess.Popen, timeout: float) -> Optional[str]:
    """A line from the worker; '' if it died, None if it hung past ``timeout``."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        return None
    return proc.stdout.readline()


def failures(results: Dict[str, Counter]) -> Dict[str, int]:
    """Crashes, hangs and silently different logits outside ExecuTorch's own FlatBuffer."""
    bad: Dict[str, int] = {}
    for kind, c in results.items():
        if kind.startswith("executorch_"):
            continue
        n = c["crash"] + c["hang"] + c["different"]
        if n:
            bad[kind] = n
    return bad


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pte", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=300)
    p.add_argument("--json", type=Path, help="write the counts here")
    p.add_argument("--no-aoti-checks", action="store_true", help="AOTInductor's per-run input checks off")
    a = p.parse_args(argv)
    results = fuzz(a.pte, a.seed, a.count, aoti_checks=not a.no_aoti_checks)
    table = {k: dict(v) for k, v in sorted(results.items())}
    for kind, c in table.items():
        print(f"{kind:22s} " + "  ".join(f"{o}={n}" for o, n in sorted(c.items())))
    if a.json:
        a.json.write_text(json.dumps({"seed": a.seed, "count": a.count, "aoti_checks": not a.no_aoti_checks,
                                      "results": table}, indent=1))
    bad = failures(results)
    print("FAIL " + str(bad) if bad else "PASS: no crash, hang or silently different logits outside ExecuTorch's FlatBuffer")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
