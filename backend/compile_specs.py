"""The compile specs the partitioner writes and the backend (and runtime) read.

Values are ASCII so that the C++ delegate can parse the ones it needs
(``step_width``) without a schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.extension.llm.cache.reference_cache import LayerKind, LayerPolicy

from offgraph_kv.schemas.manifest import dtype_from_name, dtype_short_name

STEP_WIDTH = "step_width"  # "input_index:dim": which delegate input carries the step's token count
DEVICE = "device"
STORAGE_DTYPE = "storage_dtype"
INITIAL_CAPACITY = "initial_capacity"
MAX_CAPACITY = "max_capacity"
CAPACITY_BOUND = "capacity_bound"
GROWTH_FACTOR = "growth_factor"
MAX_WRITE = "max_write"
LAYERS = "layers"
REWIND_BUDGET = "rewind_budget"  # optional: absent means 0

@dataclass(frozen=True)
class StepWidth:
    input_index: int
    dim: int

    def __str__(self) -> str:
        return f"{self.input_index}:{self.dim}"

    @classmethod
    def parse(cls, text: "str | Tuple[int, int] | StepWidth") -> "StepWidth":
        if isinstance(text, StepWidth):
            return text
        if isinstance(text, tuple):
            return cls(int(text[0]), int(text[1]))
        parts = text.split(":")
        if len(parts) != 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
            raise ValueError(f"step_width {text!r} is not of the form 'input_index:dim'")
        index, dim = int(parts[0]), int(parts[1])
        if index < 0 or dim < 0:
            raise ValueError(f"step_width {text!r}: input index and dim must be non-negative")
        return cls(index, dim)


def encode_layers(layers: Sequence[LayerPolicy]) -> str:
    return ",".join("flat" if p.kind is LayerKind.FLAT else f"ring:{p.window}" for p in layers)


def decode_layers(text: str) -> List[LayerPolicy]:
    out = []
    for item in text.split(","):
        if item == "flat":
            out.append(LayerPolicy.flat())
        elif item.startswith("ring:"):
            out.append(LayerPolicy.ring(int(item[5:])))
        else:
            raise ValueError(f"layers compile spec: unknown policy {item!r}")
    return out


@dataclass(frozen=True)
class BackendSpecs:
    """Everything preprocess needs, decoded from the compile specs."""

    step_width: StepWidth
    device: str
    storage_dtype: torch.dtype
    initial_capacity: int
    max_capacity: int
    capacity_bound: int
    growth_factor: float
    max_write: int
    layers: Tuple[LayerPolicy, ...]
    rewind_budget: int = 0

    def to_compile_specs(self) -> List[CompileSpec]:
        values = {
            STEP_WIDTH: str(self.step_width),
            DEVICE: self.device,
            STORAGE_DTYPE: dtype_short_name(self.storage_dtype),
            INITIAL_CAPACITY: str(self.initial_capacity),
            MAX_CAPACITY: str(self.max_capacity),
            CAPACITY_BOUND: str(self.capacity_bound),
            GROWTH_FACTOR: repr(float(self.growth_factor)),
            MAX_WRITE: str(self.max_write),
            LAYERS: encode_layers(self.layers),
            REWIND_BUDGET: str(self.rewind_budget),
        }
        return [CompileSpec(k, v.encode("ascii")) for k, v in values.items()]

    @classmethod
    def from_compile_specs(cls, specs: Sequence[CompileSpec]) -> "BackendSpecs":
        values = {s.key: bytes(s.value).decode("ascii") for s in specs}
        required = [STEP_WIDTH, DEVICE, STORAGE_DTYPE, INITIAL_CAPACITY, MAX_CAPACITY,
                    CAPACITY_BOUND, GROWTH_FACTOR, MAX_WRITE, LAYERS]
        missing = [k for k in required if k not in values]
        if missing:
            raise ValueError(f"OffGraphKVBackend: compile specs lack {missing}; lower with OffGraphKVPartitioner")
        return cls(
            step_width=StepWidth.parse(values[STEP_WIDTH]),
            device=values[DEVICE],
            storage_dtype=dtype_from_name(values[STORAGE_DTYPE]),
            initial_capacity=int(values[INITIAL_CAPACITY]),
            max_capacity=int(values[MAX_CAPACITY]),
            capacity_bound=int(values[CAPACITY_BOUND]),
            growth_factor=float(values[GROWTH_FACTOR]),
            max_write=int(values[MAX_WRITE]),
            layers=tuple(decode_layers(values[LAYERS])),
            rewind_budget=int(values.get(REWIND_BUDGET, "0")),
        )
