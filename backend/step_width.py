"""Locating the step width: which delegate input carries this step's token count.

The export side knows it from its own signature; the runtime reads only that
input's extent, never its data. Indices count the *delegate's* inputs in the
order the runtime passes them, which ExecuTorch fixes when it fuses the
partition: external inputs in order of first use inside the partition (the
model's argument order only when the model uses its arguments in that order).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch.export import ExportedProgram

from offgraph_kv.backend.cache_ops import CacheOpSite, LoweringError, same_size
from offgraph_kv.backend.compile_specs import StepWidth


def export_upper_bound(ep: ExportedProgram, size: torch.SymInt) -> Optional[int]:
    """The export's upper bound of a symbolic extent, or None when it has none
    (``Dim.DYNAMIC`` / ``Dim.AUTO``: torch's unbounded ``int_oo`` calls itself
    finite, and ``int()`` of it fails, so neither test alone is enough)."""
    upper = ep.range_constraints.get(size.node.expr)
    if upper is None:
        return None
    upper = upper.upper
    try:
        return int(upper) if upper.is_finite else None
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None


def step_width_bound(ep: ExportedProgram, width: "int | torch.SymInt") -> int:
    """The widest step the export allows: the width itself when static, else its export bound,
    which must exist (it sizes rings and checks every step)."""
    if not isinstance(width, torch.SymInt):
        return int(width)
    bound = export_upper_bound(ep, width)
    if bound is None or bound >= 2**31:
        raise LoweringError(
            f"the step width {width} has no finite export bound; export it with "
            "torch.export.Dim(..., max=<widest step>) (the bound sizes rings and checks every step)"
        )
    return bound


def shape_of(node: torch.fx.Node) -> Optional[torch.Size]:
    val = node.meta.get("val")
    return val.shape if isinstance(val, torch.Tensor) else None


def delegate_input_nodes(ep: ExportedProgram, nodes: "set[torch.fx.Node]") -> List[torch.fx.Node]:
    """The partition's runtime inputs in the order the lowered module takes them.

    Mirrors how ExecuTorch fuses a partition (torch.fx's ``fuse_as_graphmodule``
    over the tagged nodes in graph order): each node's inputs are visited in
    argument order and an outside node becomes an input at its first use.
    Parameters, buffers and constants are owned by the delegate (tagged with
    it), so they are not runtime inputs. ``preprocess`` checks the result
    against the inputs it actually receives.
    """
    sig = ep.graph_signature
    owned = set(sig.inputs_to_parameters) | set(sig.inputs_to_buffers) | set(sig.inputs_to_lifted_tensor_constants)
    order: List[torch.fx.Node] = []
    seen = set()
    for node in ep.graph.nodes:
        if node not in nodes:
            continue
        for arg in node.all_input_nodes:
            if arg in nodes or arg in seen:
                continue
            seen.add(arg)
            if not (arg.op == "placeholder" and arg.name in owned):
                order.append(arg)
    return order


def _listing(names: Sequence[str], shapes: Sequence[Optional[torch.Size]]) -> str:
    return ", ".join(f"{i}: {n} {list(s) if s is not None else '(not a tensor)'}"
                     for i, (n, s) in enumerate(zip(names, shapes)))


def locate(sites: Sequence[CacheOpSite], input_names: Sequence[str], input_shapes: Sequence[Optional[torch.Size]],
           given: "str | StepWidth | None") -> StepWidth:
    """Derive the locator from the inputs' shapes, or check the one given.

    ``input_names``/``input_shapes`` are the delegate inputs in the runtime's
    order (shape None for a non-tensor).
    """
    inputs = f"the delegate's inputs, in the runtime's order, are [{_listing(input_names, input_shapes)}]"
    width = sites[0].width
    for s in sites[1:]:
        if not same_size(s.width, width):
            raise LoweringError(
                f"{s.node.name}: step width {s.width} differs from {sites[0].node.name}'s {width}; "
                "every layer must see the same step"
            )
    if given is not None:
        loc = StepWidth.parse(given)
        if loc.input_index >= len(input_shapes) or input_shapes[loc.input_index] is None:
            raise LoweringError(
                f"step_width '{loc}': input {loc.input_index} is not a tensor input; {inputs}"
            )
        shape = input_shapes[loc.input_index]
        if loc.dim >= len(shape):
            raise LoweringError(f"step_width '{loc}': input {loc.input_index} has only {len(shape)} dims; {inputs}")
        if not same_size(shape[loc.dim], width):
            raise LoweringError(
                f"step_width '{loc}': input {loc.input_index} dim {loc.dim} has extent {shape[loc.dim]}, "
                f"but the cache op's step width is {width}; {inputs}"
            )
        return loc
    matches: List[StepWidth] = [
        StepWidth(i, d)
        for i, shape in enumerate(input_shapes)
        if shape is not None
        for d, size in enumerate(shape)
        if same_size(size, width)
    ]
    if not matches:
        raise LoweringError(
            f"no delegate input has a dimension equal to the step width {width}; {inputs}"
        )
    # A static width (a decode-only export) may match several dims; any of them
    # reads the same extent, and the runtime checks every static dim anyway.
    return matches[0]
