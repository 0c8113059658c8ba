"""Locating the step width: which delegate input carries this step's token count.

The export side knows it from its own signature; the runtime reads only that
input's extent, never its data.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from offgraph_kv.backend.cache_ops import CacheOpSite, LoweringError
from offgraph_kv.backend.compile_specs import StepWidth


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return (
            isinstance(a, torch.SymInt)
            and isinstance(b, torch.SymInt)
            and a.node.expr == b.node.expr
        )
    return a == b


def locate(sites: Sequence[CacheOpSite], input_shapes: Sequence[Optional[torch.Size]],
           given: "str | StepWidth | None") -> StepWidth:
    """Derive the locator from the inputs' shapes, or check the one given.

    ``input_shapes`` are the delegate inputs in order (None for a non-tensor).
    """
    width = sites[0].width
    for s in sites[1:]:
        if not _same(s.width, width):
            raise LoweringError(
                f"{s.node.name}: step width {s.width} differs from {sites[0].node.name}'s {width}; "
                "every layer must see the same step"
            )
    if given is not None:
        loc = StepWidth.parse(given)
        if loc.input_index >= len(input_shapes) or input_shapes[loc.input_index] is None:
            raise LoweringError(
                f"step_width '{loc}': the partition has {len(input_shapes)} inputs; input {loc.input_index} is not a tensor input"
            )
        shape = input_shapes[loc.input_index]
        if loc.dim >= len(shape):
            raise LoweringError(f"step_width '{loc}': input {loc.input_index} has only {len(shape)} dims {list(shape)}")
        if not _same(shape[loc.dim], width):
            raise LoweringError(
                f"step_width '{loc}': input {loc.input_index} dim {loc.dim} has extent {shape[loc.dim]}, "
                f"but the cache op's step width is {width}"
            )
        return loc
    matches: List[StepWidth] = [
        StepWidth(i, d)
        for i, shape in enumerate(input_shapes)
        if shape is not None
        for d, size in enumerate(shape)
        if _same(size, width)
    ]
    if not matches:
        raise LoweringError(
            f"no delegate input has a dimension equal to the step width {width}; pass step_width='input_index:dim'"
        )
    if not isinstance(width, torch.SymInt) and len(matches) > 1:
        raise LoweringError(
            f"the step width is the static {width} and several inputs match ({', '.join(map(str, matches))}); "
            "pass step_width='input_index:dim'"
        )
    return matches[0]
