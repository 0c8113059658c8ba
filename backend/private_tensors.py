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
import torch.nn.functional as F
from torch import fx, nn

from offgraph_kv.backend.cache_ops import CacheOpSite, find_sites, is_cache_op

_BOUND = threading.local()


@contextmanager
def _bound(stores: Dict[int, Tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    prev = getattr(_BOUND, "stores", None)
    _BOUND.stores = stores
    try:
        yield
    finally:
        _BOUND.stores = prev


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
    keys = k_store.transpose(1, 2).to(torch.float32)
    values = v_store.transpose(1, 2).to(torch.float32)
    # Lower-right causal: query i sees keys up to s - t + i.
    key_pos = torch.arange(s, device=q.device)
    query_pos = torch.arange(t, device=q.device) + (s - t)
    mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
    out = F.scaled_dot_product_attention(
        q.to(torch.float32), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.to(out_dtype)


def _lowered_update_and_attend(q, k, v, position, layer_id, scale, out_dtype):  # noqa: ANN001
    """Stands in for the cache op while the program is re-traced for compilation."""
    k_store, v_store = _BOUND.stores[layer_id]
    return write_and_attend_flat(q, k, v, k_store, v_store, scale, out_dtype)


class PrivateTensorProgram(nn.Module):
    """The partition's program with its cache ops bound to private-tensor inputs.

    ``forward(*user_inputs, k_0, v_0, k_1, v_1, ...)``: the private tensors come
    after the delegate's own inputs, two per layer in layer order.
    """

    def __init__(self, program: fx.GraphModule, num_user_inputs: int, num_layers: int) -> None:
        super().__init__()
        self.program = program
        self.num_user_inputs = num_user_inputs
        self.num_layers = num_layers

    def forward(self, *args: torch.Tensor):  # noqa: ANN201
        user, private = args[: self.num_user_inputs], args[self.num_user_inputs:]
        stores = {i: (private[2 * i], private[2 * i + 1]) for i in range(self.num_layers)}
        with _bound(stores):
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
    sites: Sequence[CacheOpSite], rows: int, dtype: torch.dtype, device: str
) -> List[torch.Tensor]:
    """Example K/V storage for tracing: ``[1, rows, H_kv, D]`` per tensor."""
    out = []
    for s in sites:
        out.append(torch.zeros(1, rows, s.num_kv_heads, s.head_dim, dtype=dtype, device=device))
        out.append(torch.zeros(1, rows, s.num_kv_heads, s.v_head_dim, dtype=dtype, device=device))
    return out
