"""The end-to-end half of tools/sanitize.sh: export a toy decoder (``export``), or
generate with it through executorch.runtime, growing the store several times,
rewinding and resetting, and compare with the eager oracle (``run``)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "examples" / "llama"))


def _use_package_at(site: str) -> None:
    """Import offgraph_kv from ``site`` (the sanitized build), not the editable
    install, whose import hook would otherwise win over sys.path."""
    sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("_editable_skbc_offgraph_kv")]
    sys.path.insert(0, site)


def main(argv: "list[str]") -> int:
    mode, pte = argv[0], Path(argv[1])
    if len(argv) > 2:
        _use_package_at(argv[2])
    import torch
    from conftest import Oracle, Session, configured, greedy, lower, prompt, toy_model

    import offgraph_kv.runtime

    model = toy_model()
    if mode == "export":
        pte.write_bytes(lower(model, storage_dtype=torch.float32, initial_capacity=4))
        return 0
    print("runtime module:", offgraph_kv.runtime._runtime.__file__)
    if len(argv) > 2:
        assert offgraph_kv.runtime._runtime.__file__.startswith(str(Path(argv[2]).resolve())), "not the sanitized build"
    with configured(initial_capacity=4, rewind_budget=0):
        session = Session(pte)
    oracle = Oracle(model, torch.float32)
    got, want = session.step(prompt(9)), oracle.step(prompt(9))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    nxt = greedy(got)
    for _ in range(60):  # 4 -> 8 -> 16 -> ... -> 128 rows
        got, want = session.step(nxt), oracle.step(nxt)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        nxt = greedy(got)
    store = session.store
    m = store.metrics()
    # Saved context round trip, then one more step against the oracle.
    saved = pte.with_suffix(".ctx")
    store.save(str(saved))
    store.reset(release_memory=True)
    store.load(str(saved))
    torch.testing.assert_close(session.step(nxt), oracle.step(nxt), atol=1e-4, rtol=1e-4)
    store.rewind(5)
    store.reset(release_memory=True)
    print(f"generated 70 tokens, {m['growths']} growths, capacity {m['capacity']}, save/load/rewind/reset: "
          "matches the oracle")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
