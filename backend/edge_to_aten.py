"""Turn an edge-dialect program back into plain ATen for AOTInductor.

Edge dialect functionalises views into ``*_copy`` ops. The partition is pure
(the cache op is functional, so nothing in it mutates), which makes every
``X_copy`` safe to compile as the view ``X``; some copies (``split_copy``) have no
AOTI C shim at all and would otherwise need a proxy executor the runtime lacks.
"""

from __future__ import annotations

import torch
from torch import fx


def _aten_overload(target: object) -> "torch._ops.OpOverload | None":
    op = getattr(target, "_op", target)  # EdgeOpOverload wraps an OpOverload
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return op if isinstance(op, torch._ops.OpOverload) else None
    base = op._schema.name.split("::")[1]
    if base.endswith("_copy"):
        packet = getattr(torch.ops.aten, base[: -len("_copy")], None)
        if packet is not None and op._overloadname in packet.overloads():
            return getattr(packet, op._overloadname)
    return op


def edge_to_aten(program: fx.GraphModule) -> fx.GraphModule:
    """Rewrite edge ops (and their view copies) to ATen in place."""
    for node in program.graph.nodes:
        if node.op == "call_function":
            aten = _aten_overload(node.target)
            if aten is not None:
                node.target = aten
    program.recompile()
    return program
