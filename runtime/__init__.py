"""Run-time face of offgraph-kv.

Importing this module registers ``OffGraphKVBackend`` with the ExecuTorch
runtime that ``executorch.runtime`` uses (one registry, one libexecutorch.so).
"""

from __future__ import annotations

from typing import Dict, List, Optional

# The compiled AOTI code links against libtorch; load it into the process first.
import torch  # noqa: F401

# CUDA programs allocate their intermediates through torch's CUDA caching
# allocator, which only Python's lazy CUDA init sets up; a program run before
# anything in the process touched CUDA would dereference an empty allocator.
if torch.cuda.is_available():
    torch.cuda.init()

from offgraph_kv.runtime._runtime import Store, get_options, last_error, set_options, stores  # noqa: F401

from offgraph_kv.schemas.manifest import check_growth_policy  # noqa: E402

from offgraph_kv.runtime.host_module import (  # noqa: E402
    HostMethod,
    RuntimeMethod,
    Sessions,
    load_method,
    pybindings_match_torch,
)

__all__ = ["Store", "HostMethod", "RuntimeMethod", "Sessions", "last_error", "configure", "load_method", "stores",
           "options", "pybindings_match_torch", "shared_weights"]


def configure(
    initial_capacity: Optional[int] = None,
    max_capacity: Optional[int] = None,
    growth_factor: Optional[float] = None,
    rewind_budget: Optional[int] = None,
    num_threads: Optional[int] = None,
    growth: Optional[str] = None,
    cuda_graphs: Optional[bool] = None,
) -> None:
    """Override the export-time growth policy (and the rings' rewind budget:
    extra slots that let a ring layer be rewound further) for methods loaded
    from now on. ``num_threads``: threads per step of the compiled code, every step
    (default: one for decode steps; for wider steps the process's OpenMP
    setting less the cores other processes are running on at that moment, at
    least one; measured in ``benchmarks/cpu/threads.py``).
    ``growth``: ``"map"`` reserves address space for ``max_capacity`` rows at
    load and backs it as the store grows (nothing copied, addresses fixed),
    falling back to copying where the device cannot (the store's metrics say
    which is in effect and why); ``"copy"`` grows into a new arena and copies;
    ``"auto"`` (the default) picks what measured better on the device.
    ``cuda_graphs`` (default on): a CUDA method whose attention reads the
    length from device memory captures its decode step as a CUDA graph after
    one warm-up step and replays it from then on (again after a copy growth
    moves the storage); ``False`` runs every step uncaptured. The store's
    metrics count ``graph_captures`` and ``graph_replays``.

    Goes through ExecuTorch's backend-options mechanism (``set_option``), so a
    C++ host does the same with ``executorch::runtime::set_option``. ``None``
    restores the export-time default. A max above the compiled bound fails at
    ``load_method``.
    """
    check_growth_policy(initial_capacity, max_capacity, growth_factor, rewind_budget)
    if num_threads is not None and not 1 <= int(num_threads) <= 1024:
        raise ValueError(f"num_threads must be in [1, 1024], got {num_threads}")
    if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
        raise ValueError(f"cuda_graphs must be True, False or None, got {cuda_graphs!r}")
    if growth is not None and growth not in ("map", "copy", "auto"):
        raise ValueError(f"growth must be 'map', 'copy' or 'auto', got {growth!r}")
    set_options(
        int(initial_capacity or 0),
        int(max_capacity or 0),
        "" if growth_factor is None else repr(float(growth_factor)),
        -1 if rewind_budget is None else int(rewind_budget),
        int(num_threads or 0),
        growth or "",
        "" if cuda_graphs is None else ("on" if cuda_graphs else "off"),
    )


def options() -> Dict[str, object]:
    """The overrides now in force (0 / "" = export default)."""
    return get_options()


def latest_store() -> Store:
    """The store of the most recently loaded method."""
    live: List[Store] = stores()
    if not live:
        raise RuntimeError("no offgraph-kv method is loaded")
    return live[-1]


def shared_weights() -> List[Dict[str, object]]:
    """The weights held in this process: one entry per program (``key``: compiled code,
    place, digest of the weight list), with ``sessions`` (loaded methods sharing it)
    and ``weight_bytes``. Empty once every method of every program is gone."""
    from offgraph_kv.runtime._runtime import shared_weights as _shared_weights

    return list(_shared_weights())
