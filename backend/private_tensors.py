"""Rewrite ``update_and_attend`` into in-graph writes + attention over private tensors.

Each cache layer gets two private tensors (K and V storage) that become extra
inputs of the compiled program. They are laid out sequence-major, ``[1, S, H, D]``,
and the runtime binds, for every step, the rows readable *after* the step
(``S = length + width``): the compiled code writes this step's K/V into the last
``width`` rows and attends over all ``S``. With B = 1 that prefix of the
allocation is contiguous, so the binding is a plain contiguous tensor (no
symbolic strides to trust) and growth is a single contiguous copy.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Dict, Iterator, List, Sequence, Tuple

import torch
from torch import fx, nn

from offgraph_kv.backend import triton_attention
from offgraph_kv.backend.attention import attend_flat, attend_masked
from offgraph_kv.backend.cache_ops import CacheOpSite, find_sites, is_cache_op
from offgraph_kv.schemas.manifest import ring_slots

_BOUND = threading.local()


@contextmanager
def _bound(stores: Dict[int, Tuple[torch.Tensor, torch.Tensor]], windows: Dict[int, int],
           length: "torch.Tensor | None", kernels: bool = False) -> Iterator[None]:
    prev = (getattr(_BOUND, "stores", None), getattr(_BOUND, "windows", None), getattr(_BOUND, "length", None),
            getattr(_BOUND, "kernels", False))
    _BOUND.stores, _BOUND.windows, _BOUND.length, _BOUND.kernels = stores, windows, length, kernels
    try:
        yield
    finally:
        _BOUND.stores, _BOUND.windows, _BOUND.length, _BOUND.kernels = prev


def write_and_attend_flat(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    scale: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """One flat layer's step, as the compiled code runs it.

    ``k_store``/``v_store`` are ``[1, S, H_kv, D]`` where the last ``T`` rows are
    this step's; everything before them is committed history.
    """
    t = q.shape[2]
    s = k_store.shape[1]
    torch._check(s >= t)
    # Write: cast to storage dtype on write, as the oracle does.
    k_store.narrow(1, s - t, t).copy_(k.transpose(1, 2))
    v_store.narrow(1, s - t, t).copy_(v.transpose(1, 2))
    return attend_flat(q, k_store, v_store, scale, out_dtype)


def write_and_attend_ring(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_ring: torch.Tensor,
    v_ring: torch.Tensor,
    length: torch.Tensor,
    window: int,
    scale: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """One ring layer's step: write at ``position mod slots``, attend a band.

    ``k_ring``/``v_ring`` are the whole ring ``[1, R, H_kv, D]`` with
    ``R = window + max_write - 1``; ``length`` (int64 ``[1]``) is the committed
    length, so this step's tokens take positions ``length .. length + T - 1``.
    Because ``R >= window + T - 1``, the slots a step overwrites only ever held
    positions already outside every window that the committed state or this
    step's own queries still need.
    """
    t = q.shape[2]
    slots = k_ring.shape[1]
    offsets = torch.arange(t, device=q.device)
    query_pos = length + offsets  # [T]
    idx = query_pos % slots
    k_ring.index_copy_(1, idx, k.transpose(1, 2).to(k_ring.dtype))
    v_ring.index_copy_(1, idx, v.transpose(1, 2).to(v_ring.dtype))
    # The newest position each slot holds after the write (negative: never written).
    total = length + t
    slot = torch.arange(slots, device=q.device)
    slot_pos = total - 1 - torch.remainder(total - 1 - slot, slots)
    qp = query_pos.unsqueeze(1)
    kp = slot_pos.unsqueeze(0)
    mask = (kp >= 0) & (kp <= qp) & (kp > qp - window)
    return attend_masked(q, k_ring, v_ring, mask, scale, out_dtype)


def _lowered_update_and_attend(q, k, v, position, layer_id, scale, out_dtype):  # noqa: ANN001
    """Stands in for the cache op while the program is re-traced for compilation."""
    k_store, v_store = _BOUND.stores[layer_id]
    window = _BOUND.windows.get(layer_id, 0)
    if _BOUND.kernels:
        # CUDA, 16-bit storage: one op writes and attends, positions from the length tensor.
        return triton_attention.update_attend(q, k, v, k_store, v_store, _BOUND.length, window, scale, out_dtype)
    if window > 0:
        return write_and_attend_ring(q, k, v, k_store, v_store, _BOUND.length, window, scale, out_dtype)
    return write_and_attend_flat(q, k, v, k_store, v_store, scale, out_dtype)


def compiled_input_index(num_user_inputs: int, layer: int, j: int) -> int:
    """Where layer ``layer``'s K (``j == 0``) or V (``j == 1``) storage sits among the compiled
    program's inputs: after the delegate's own inputs, two per layer in layer order. The one
    place this order is written: the wrapper reads its arguments by it, the manifest records it."""
    return num_user_inputs + 2 * layer + j


def length_input_index(num_user_inputs: int, num_layers: int) -> int:
    """The committed length, where the program takes it, follows every layer's K and V."""
    return compiled_input_index(num_user_inputs, num_layers, 0)


class PrivateTensorProgram(nn.Module):
    """The partition's program with its cache ops bound to private-tensor inputs.

    ``forward(*user_inputs, k_0, v_0, k_1, v_1, ..., [length])``: the private
    tensors come after the delegate's own inputs, two per layer in layer order,
    then, when any layer is a ring or the program attends through the CUDA
    kernels (``kernels``: ``triton_attention.update_attend``), the committed
    length (int64 ``[1]``).
    """

    def __init__(self, program: fx.GraphModule, num_user_inputs: int, windows: Sequence[int],
                 kernels: bool = False) -> None:
        super().__init__()
        self.program = program
        self.num_user_inputs = num_user_inputs
        self.windows = {i: w for i, w in enumerate(windows) if w > 0}
        self.num_layers = len(windows)
        self.kernels = kernels

    @property
    def has_length_input(self) -> bool:
        return bool(self.windows) or self.kernels

    def forward(self, *args: torch.Tensor):  # noqa: ANN201
        n = self.num_user_inputs
        user = args[:n]
        stores = {i: (args[compiled_input_index(n, i, 0)], args[compiled_input_index(n, i, 1)])
                  for i in range(self.num_layers)}
        length = args[length_input_index(n, self.num_layers)] if self.has_length_input else None
        with _bound(stores, self.windows, length, self.kernels):
            return self.program(*user)


def bind_private_tensors(program: fx.GraphModule) -> List[CacheOpSite]:
    """Point every cache op of an (unlifted) program at the private tensors."""
    sites = find_sites(program.graph)
    for node in program.graph.nodes:
        if is_cache_op(node):
            node.target = _lowered_update_and_attend
    program.recompile()
    return sites


def private_tensor_examples(
    sites: Sequence[CacheOpSite], rows: int, dtype: torch.dtype, device: str,
    windows: Sequence[int], max_write: int, rewind_budget: int = 0, has_length_input: bool = False,
) -> List[torch.Tensor]:
    """Example storage for tracing: ``[1, rows, H_kv, D]`` per flat tensor,
    ``[1, slots, H_kv, D]`` per ring tensor, then the length where the program
    takes one (``PrivateTensorProgram.has_length_input``: rings, or the CUDA
    kernels, which read it for every layer)."""
    out = []
    for s in sites:
        w = windows[s.layer_id]
        n = ring_slots(w, max_write, rewind_budget) if w > 0 else rows
        out.append(torch.zeros(1, n, s.num_kv_heads, s.head_dim, dtype=dtype, device=device))
        out.append(torch.zeros(1, n, s.num_kv_heads, s.v_head_dim, dtype=dtype, device=device))
    if has_length_input:
        out.append(torch.zeros(1, dtype=torch.long, device=device))
    return out
