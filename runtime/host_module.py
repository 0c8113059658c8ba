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
from typing import List, Sequence, Union

import torch

from offgraph_kv.runtime._runtime import HostRunner, clear_last_error, last_error


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class HostMethod:
    """One loaded method; ``execute`` mirrors ``executorch.runtime``'s ``Method.execute``."""

    def __init__(self, path: Union[str, Path], method: str = "forward") -> None:
        self._runner = HostRunner(str(path), method)

    def execute(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        dense = []
        for i, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"input {i}: expected a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cpu":
                raise ValueError(f"input {i}: method inputs are host tensors, got one on {t.device}")
            dense.append(t.contiguous())  # kept alive until run returns
        outs = self._runner.run([(t.data_ptr(), list(t.shape), _dtype_name(t.dtype)) for t in dense])
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

    def __init__(self, path: Union[str, Path], method: str) -> None:
        from executorch.runtime import Runtime, Verification

        clear_last_error()
        try:
            # InternalConsistency: a corrupt program FlatBuffer is an error, not a crash in Init.
            self.program = Runtime.get().load_program(str(path), verification=Verification.InternalConsistency)
            self.method = self.program.load_method(method)
        except RuntimeError as err:
            raise _with_delegate_message(err) from err

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
    if os.environ.get("OFFGRAPH_KV_HOST_RUNNER") != "1" and pybindings_match_torch():
        return RuntimeMethod(path, method)
    return HostMethod(path, method)
