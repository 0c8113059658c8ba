"""Lowering face: rewrites the cache op onto private tensors and compiles with AOTInductor."""

from offgraph_kv.backend.backend import OffGraphKVBackend  # noqa: F401
