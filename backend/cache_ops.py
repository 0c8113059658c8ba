"""Finding and checking the ``kvcache::update_and_attend`` nodes of a graph."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List

import torch
from torch import fx

OP_NAME = "kvcache::update_and_attend"


class LoweringError(ValueError):
    """A model the offgraph-kv backend cannot lower; the message names the node."""


def is_cache_op(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    name = getattr(target, "_name", None) or getattr(getattr(target, "_op", None), "_name", None)
    return name == OP_NAME


@dataclass(frozen=True)
class CacheOpSite:
    """What lowering needs to know about one attention site."""

    node: fx.Node
    layer_id: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    width: "int | torch.SymInt"  # the step's token count, q.shape[2]
    scale: float
    out_dtype: torch.dtype


def same_size(a: object, b: object) -> bool:
    """Two extents are the same symbol or the same number (no guard is added)."""
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and a.node.expr == b.node.expr
    return a == b


def _shape(node: fx.Node, arg: object, what: str) -> torch.Size:
    if not isinstance(arg, fx.Node) or not isinstance(arg.meta.get("val"), torch.Tensor):
        raise LoweringError(f"{node.name}: argument {what} is not a tensor")
    return arg.meta["val"].shape


def read_site(node: fx.Node) -> CacheOpSite:
    """Check one op node's arguments and describe it, or raise naming the problem."""
    if len(node.args) != 7:
        raise LoweringError(f"{node.name}: expected 7 arguments to {OP_NAME}, got {len(node.args)}")
    q, k, v, position, layer_id, scale, out_dtype = node.args
    qs, ks, vs = _shape(node, q, "q"), _shape(node, k, "k"), _shape(node, v, "v")
    ps = _shape(node, position, "position")
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        raise LoweringError(f"{node.name}: q, k and v must be 4-D [B, H, T, D], got {list(qs)}, {list(ks)}, {list(vs)}")
    if not isinstance(layer_id, int):
        raise LoweringError(f"{node.name}: layer_id must be a constant int, got {layer_id!r}")
    if qs[0] != 1 or ks[0] != 1 or vs[0] != 1:
        raise LoweringError(f"{node.name} (layer {layer_id}): batch must be 1, got q {qs[0]}, k {ks[0]}, v {vs[0]}")
    if isinstance(qs[1], torch.SymInt) or isinstance(ks[1], torch.SymInt) or isinstance(qs[3], torch.SymInt):
        raise LoweringError(f"{node.name} (layer {layer_id}): head counts and head dim must be static")
    if qs[1] % ks[1] != 0:
        raise LoweringError(
            f"{node.name} (layer {layer_id}): {qs[1]} query heads is not a multiple of {ks[1]} KV heads"
        )
    # v may have its own head dim (the op allows it, e.g. MLA); heads and steps must match.
    if ks[1] != vs[1] or qs[3] != ks[3] or not (same_size(qs[2], ks[2]) and same_size(ks[2], vs[2])):
        raise LoweringError(f"{node.name} (layer {layer_id}): k {list(ks)} and v {list(vs)} do not match q {list(qs)}")
    if isinstance(vs[3], torch.SymInt):
        raise LoweringError(f"{node.name} (layer {layer_id}): v head dim must be static")
    if ks[1] < 1 or ks[3] < 1 or vs[3] < 1:
        raise LoweringError(f"{node.name} (layer {layer_id}): heads and head dims must be at least 1, "
                            f"got {ks[1]} KV heads, head dims {ks[3]} (k) and {vs[3]} (v)")
    # The op's contract: position is [q_len, n_dims] ints, one row per query token.
    # This store appends at its committed length (as the reference cache does),
    # so it reads no position values, but the layout must still be the op's.
    if len(ps) != 2 or not same_size(ps[0], qs[2]) or isinstance(ps[1], torch.SymInt):
        raise LoweringError(
            f"{node.name} (layer {layer_id}): position must be [T, n_dims] with T = {qs[2]} query tokens "
            f"(e.g. [T, 1]: positions.reshape(-1, 1)), got {list(ps)}"
        )
    if position.meta["val"].dtype.is_floating_point or position.meta["val"].dtype == torch.bool:
        raise LoweringError(f"{node.name} (layer {layer_id}): position must be integer, got {position.meta['val'].dtype}")
    if not isinstance(out_dtype, torch.dtype):
        raise LoweringError(f"{node.name} (layer {layer_id}): out_dtype must be a constant dtype")
    return CacheOpSite(
        node=node,
        layer_id=layer_id,
        num_q_heads=int(qs[1]),
        num_kv_heads=int(ks[1]),
        head_dim=int(ks[3]),
        v_head_dim=int(vs[3]),
        width=qs[2],
        scale=float(scale),
        out_dtype=out_dtype,
    )


def find_sites(graph: fx.Graph) -> List[CacheOpSite]:
    """Every cache op, checked, in layer order; layer ids must be unique.

    Ids need not be dense: a hybrid model whose attention sits in blocks 0, 2
    and 5 may pass the block index, as ExecuTorch's reference cache allows. The
    cache layers are then numbered by their ids' order (0, 1, 2): the ops'
    ``layer_id`` arguments are rewritten to that number, which is what the
    manifest, the compiled program's inputs and per-layer policies count.
    """
    sites = [read_site(n) for n in graph.nodes if is_cache_op(n)]
    seen = {}
    for s in sites:
        if s.layer_id in seen:
            raise LoweringError(
                f"{s.node.name}: layer_id {s.layer_id} is also used by {seen[s.layer_id].name}; each layer needs its own cache"
            )
        seen[s.layer_id] = s.node
    if any(lid < 0 for lid in seen):
        raise LoweringError(f"layer ids must be non-negative, got {sorted(seen)}")
    rank = {lid: i for i, lid in enumerate(sorted(seen))}
    dense = []
    for s in sites:
        i = rank[s.layer_id]
        if i != s.layer_id:
            s.node.args = s.node.args[:4] + (i,) + s.node.args[5:]
            s = replace(s, layer_id=i)
        dense.append(s)
    return sorted(dense, key=lambda s: s.layer_id)
