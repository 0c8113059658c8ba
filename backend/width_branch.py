"""A branch on the step's width, kept in the compiled code: one program takes
one-token (decode) steps through one kernel and wider (prefill) steps
through another."""

from __future__ import annotations

from typing import Any, Callable, Sequence, Tuple, Union

import torch


def by_width(width: Union[int, torch.SymInt], one: Callable[..., Any], many: Callable[..., Any],
             operands: Sequence[torch.Tensor]) -> Any:
    """``one(*operands)`` when ``width`` is 1, ``many(*operands)`` otherwise.

    Where both are the same function (a kernel that takes every width) there is
    no branch: each cond costs the compiled step a few tensor-handle calls, and
    a bf16 SmolLM2 has 211 linears.

    A static width picks its branch here. A symbolic one becomes a cond in the
    graph, traced by calling the cond operator itself: ``torch.cond`` first
    compiles each call with dynamo to check its branches, about half a second a
    call on these 2 cores, two minutes for SmolLM2's ~240 branches. Our branches
    are functions of their operands alone, which is all the operator needs.
    """
    if one is many:
        return one(*operands)
    if isinstance(width, int):
        return one(*operands) if width == 1 else many(*operands)
    # The operator's branches return tuples of tensors (torch.cond wraps a lone tensor the same way).
    single = []

    def as_tuple(fn: Callable[..., Any]) -> Callable[..., Tuple[torch.Tensor, ...]]:
        def branch(*args: torch.Tensor) -> Tuple[torch.Tensor, ...]:
            out = fn(*args)
            single.append(isinstance(out, torch.Tensor))
            return (out,) if single[-1] else tuple(out)
        return branch

    out = torch.ops.higher_order.cond(width == 1, as_tuple(one), as_tuple(many), tuple(operands))
    return out[0] if single[-1] else tuple(out)
