"""Run a .pte through ExecuTorch's C++ ``Module`` with plain host buffers.

``executorch.runtime`` hands tensors to its C++ side through the ATen ABI of
the torch it was built against (2.13). Where a different torch is loaded (the
H200 image ships 2.11 with CUDA), that hand-off fails before any backend runs.
``HostMethod`` talks to the same libexecutorch.so through pointers, sizes and
dtype names only, so it works with any torch; on a matching torch it gives the
same results as ``executorch.runtime`` (tests/test_host_runner.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch

from offgraph_kv.runtime._runtime import HostRunner, Store, clear_last_error, last_error, take_last_store


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class HostMethod:
    """One loaded method; ``execute`` mirrors ``executorch.runtime``'s ``Method.execute``."""

    def __init__(self, path: Union[str, Path], method: str = "forward", *, _runner: Optional[HostRunner] = None) -> None:
        self._runner = _runner if _runner is not None else HostRunner(str(path), method)
        self.path = Path(path)

    @property
    def store(self) -> Optional[Store]:
        """The KV store this method owns."""
        return self._runner.store

    def new_session(self) -> "HostMethod":
        """The method loaded again over the same Program (ExecuTorch's ``Module(program)``):
        its own KV store and planned memory, the compiled code and the weights shared."""
        return HostMethod(self.path, _runner=self._runner.new_session())

    @staticmethod
    def _dense(inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        dense = []
        for i, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"input {i}: expected a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cpu":
                raise ValueError(f"input {i}: method inputs are host tensors, got one on {t.device}")
            dense.append(t.contiguous())  # kept alive until the call returns
        return dense

    @staticmethod
    def _described(dense: Sequence[torch.Tensor]) -> list:
        return [(t.data_ptr(), list(t.shape), _dtype_name(t.dtype)) for t in dense]

    def decode_greedy(self, inputs: Sequence[torch.Tensor], steps: int, token_input: int = 0, position_input: int = 1,
                      stop_ids: Sequence[int] = (), logits_output: int = 0) -> Tuple[List[int], List[int]]:
        """Up to ``steps`` greedy one-token steps in the runtime's C++ loop, as
        ExecuTorch's C++ LLM runner decodes: no Python between tokens. ``inputs``
        are the first step's; each step feeds back the argmax of the last row of
        output ``logits_output`` and advances every position by one; the loop
        also ends after a token in ``stop_ids``. Returns the tokens and each
        step's host nanoseconds. A failed step raises; the steps before it stand."""
        dense = self._dense(inputs)
        tokens, step_ns = self._runner.decode_greedy(self._described(dense), token_input, position_input, steps,
                                                     list(stop_ids), logits_output)
        return list(tokens), list(step_ns)

    def execute(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        dense = self._dense(inputs)  # alive until run returns
        outs = self._runner.run(self._described(dense))
        result = []
        for dtype, sizes, payload in outs:
            # The bytearray is already our own copy: wrap it, do not copy again.
            flat = torch.frombuffer(payload, dtype=getattr(torch, dtype)) if payload else \
                torch.empty(0, dtype=getattr(torch, dtype))
            result.append(flat.reshape(sizes))
        return result


# executorch 1.5.1's Python bindings are built against this torch.
PYBINDINGS_TORCH = "2.13.0"


def pybindings_match_torch() -> bool:
    """Whether ``executorch.runtime`` can exchange tensors with the torch in this process."""
    return torch.__version__.split("+")[0] == PYBINDINGS_TORCH


def _with_delegate_message(err: Exception) -> RuntimeError:
    """executorch.runtime's exceptions carry only an error code; add what the delegate said."""
    said = last_error()
    return RuntimeError(f"{err} ({said})" if said else str(err))


class RuntimeMethod:
    """A method loaded through ``executorch.runtime`` whose errors name the problem."""

    def __init__(self, path: Union[str, Path], method: str = "forward", *, _program: object = None) -> None:
        from executorch.runtime import Method, Runtime, Verification

        clear_last_error()
        take_last_store()  # forget a store of an earlier load on this thread
        self.path = Path(path)
        self.method_name = method
        try:
            # InternalConsistency: a corrupt program FlatBuffer is an error, not a crash in Init.
            program = _program if _program is not None else \
                Runtime.get().load_program(str(path), verification=Verification.InternalConsistency)
            # executorch.runtime's Program caches one Method per name (and keeps it as
            # long as the Program); its underlying program loads a new one, a new
            # delegate init, each time, freed with this object.
            inner = getattr(program, "_program", None)
            loaded = Method(inner.load_method(method)) if inner is not None else program.load_method(method)
        except RuntimeError as err:
            raise _with_delegate_message(err) from err
        # (executorch.runtime's Method keeps its program alive, so the order they go in does not matter.)
        self.program = program
        self.method = loaded
        self.store: Optional[Store] = take_last_store()

    def new_session(self) -> "RuntimeMethod":
        """The method loaded again from the same Program: its own KV store, the compiled
        code and the weights shared. Methods of one Program share its activation memory
        (executorch.runtime's rule for host methods), so its sessions take turns; for
        sessions on different threads load a Program per thread (``RuntimeMethod(path)``),
        which still shares the code and the weights."""
        return RuntimeMethod(self.path, self.method_name, _program=self.program)

    def execute(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        clear_last_error()
        try:
            return self.method.execute(inputs)
        except RuntimeError as err:
            raise _with_delegate_message(err) from err


def load_method(path: Union[str, Path], method: str = "forward") -> object:
    """Load ``method`` of a .pte for execution from Python: through ``executorch.runtime``
    where its bindings match this process's torch, else through ``HostMethod``
    (``OFFGRAPH_KV_HOST_RUNNER=1`` forces the latter). Either has ``execute(inputs)``,
    and either raises ``RuntimeError`` with the delegate's message."""
    check_program_file(path)
    if os.environ.get("OFFGRAPH_KV_HOST_RUNNER") != "1" and pybindings_match_torch():
        return RuntimeMethod(path, method)
    return HostMethod(path, method)


def check_program_file(path: Union[str, Path]) -> None:
    """Refuse what is plainly not a .pte before ExecuTorch's loader sees it: executorch.runtime
    logs the file's FlatBuffer identifier as text, and identifier bytes that are not UTF-8
    abort the process from inside its log callback."""
    p = Path(path)
    if not p.is_file():
        raise RuntimeError(f"loading program {p}: {'not a regular file' if p.exists() else 'no such file'}")
    with open(p, "rb") as f:
        head = f.read(8)
    if not (head[4:6] == b"ET" and head[6:8].isascii()):
        raise RuntimeError(f"loading program {p}: not an ExecuTorch program (no 'ET' FlatBuffer identifier "
                           f"at bytes 4-8, found {head[4:8]!r})")


class Sessions:
    """Several conversations over one loaded program: the compiled code and the
    weights are in memory once per process, each session has its own KV store.

    ``sessions = Sessions("model.pte", 3)``; ``sessions[i].execute(inputs)`` runs a step
    of conversation ``i`` (any order, any interleaving); ``sessions[i].store`` is its
    store (rewind, save, metrics); ``sessions.add()`` opens another,
    ``sessions.close(i)`` drops one. Memory: weights once + the sessions' KV.
    The sessions of one ``Sessions`` take turns (one thread at a time); give each
    thread its own ``Sessions`` to run concurrently; they still share the weights.
    """

    def __init__(self, path: Union[str, Path], count: int = 1, method: str = "forward") -> None:
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be a positive int, got {count!r}")
        first = load_method(path, method)
        self._sessions: List[Union[RuntimeMethod, HostMethod]] = [first]
        for _ in range(count - 1):
            self.add()

    def add(self) -> Union["RuntimeMethod", HostMethod]:
        """Open one more session (the method loaded again over the same Program)."""
        if not self._sessions:
            raise RuntimeError("every session was closed; create a new Sessions")
        session = self._sessions[0].new_session()
        self._sessions.append(session)
        return session

    def close(self, index: int) -> None:
        """Drop session ``index`` and its KV store (the weights stay while any session remains)."""
        del self._sessions[index]

    def __getitem__(self, index: int) -> Union["RuntimeMethod", HostMethod]:
        return self._sessions[index]

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Union["RuntimeMethod", HostMethod]]:
        return iter(self._sessions)
