"""Exports that take minutes, run beside the tests instead of in their way.

Most tests keep one core busy (one OpenMP thread, single-threaded tracing and
compiling), so on CI's 2 cores an export started when the session starts runs
on the core the tests leave idle. The exports run one after another in their
own processes, in the order given, each with an inductor cache of its own (no
compile shares cache files with the tests' compiles); a test asks for one by
name and waits only if it is not done yet.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
EXPORT = REPO / "examples" / "llama" / "export.py"


class BackgroundExports:
    def __init__(self, jobs: Sequence[Tuple[str, List[str]]]) -> None:
        """``jobs``: (name, export.py arguments without --out), run in this order."""
        self.root = Path(tempfile.mkdtemp(prefix="offgraph_kv_background_"))
        self._jobs = list(jobs)
        self._done: Dict[str, threading.Event] = {name: threading.Event() for name, _ in self._jobs}
        self._result: Dict[str, Tuple[int, str]] = {}
        self._stop = False
        self._current: "subprocess.Popen | None" = None
        self._thread = threading.Thread(target=self._run_all, name="background-exports", daemon=True)
        self._thread.start()

    def out(self, name: str) -> Path:
        return self.root / f"{name}.pte"

    def _run_all(self) -> None:
        env = dict(os.environ, OFFGRAPH_KV_INDUCTOR_CACHE=str(self.root / "inductor"))
        for name, argv in self._jobs:
            log = self.root / f"{name}.log"
            if self._stop:
                self._result[name] = (-1, "the session ended before this export started")
            else:
                with open(log, "w") as f:
                    self._current = subprocess.Popen([sys.executable, str(EXPORT), *argv, "--out", str(self.out(name))],
                                                     stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
                    rc = self._current.wait()
                self._result[name] = (rc, log.read_text()[-4000:] if rc != 0 else "")
            self._done[name].set()

    def get(self, name: str) -> Path:
        """The finished export's .pte; raises with the export's own output if it failed."""
        self._done[name].wait()
        rc, tail = self._result[name]
        if rc != 0:
            raise RuntimeError(f"background export {name!r} exited {rc}:\n{tail}")
        return self.out(name)

    def close(self) -> None:
        self._stop = True
        if self._current is not None and self._current.poll() is None:
            self._current.kill()
        self._thread.join(timeout=30)
        shutil.rmtree(self.root, ignore_errors=True)
