"""Ahead-of-time face: claims the decoder subgraph and sets its compile specs."""

from offgraph_kv.partitioner.partitioner import OffGraphKVPartitioner  # noqa: F401
