"""Python writer and reader of the payload-free manifest (``manifest.fbs``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Tuple

import torch

from offgraph_kv.schemas import manifest_generated as fb

# Bump when a reader of the previous version could misread a new manifest.
# 2: the delegate inputs (dtype, static / step-width / dynamic dims) and the width bound.
# 3: weights outside the compiled code (a version-2 runtime would run the code
# without them).
# 4: the compiled interface, covered by the code's digest; the runtime
# cross-checks the manifest against it at load and refuses manifests without it.
MANIFEST_VERSION = 4
READABLE_VERSIONS = (4,)
FILE_IDENTIFIER = b"OGKV"

STORAGE_DTYPES = {
    torch.float32: fb.StorageDType.Float32,
    torch.float16: fb.StorageDType.Float16,
    torch.bfloat16: fb.StorageDType.BFloat16,
}
_DTYPE_NAMES = {
    "fp32": torch.float32, "float32": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
}
DEVICES = {"cpu": fb.Device.CPU, "cuda": fb.Device.CUDA}
LAYER_KINDS = {"flat": fb.LayerKind.Flat, "ring": fb.LayerKind.Ring}
ROLES = {"key": fb.TensorRole.Key, "value": fb.TensorRole.Value}


# ExecuTorch ScalarType codes (c10's numbering), for the delegate inputs' dtypes.
SCALAR_TYPES = {
    torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4,
    torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.bool: 11, torch.bfloat16: 15,
}
DIM_KINDS = {"static": fb.DimKind.Static, "width": fb.DimKind.StepWidth, "dynamic": fb.DimKind.Dynamic}


class ManifestError(ValueError):
    """A manifest that is malformed or disagrees with the program it describes."""


def dtype_from_name(name: "str | torch.dtype", what: str = "storage_dtype") -> torch.dtype:
    """Accept ``torch.bfloat16`` or a name such as ``"bf16"`` / ``"bfloat16"``
    (the one table of dtype names; ``what`` names the setting in errors)."""
    if isinstance(name, torch.dtype):
        dtype = name
    else:
        try:
            dtype = _DTYPE_NAMES[name.lower()]
        except KeyError:
            raise ValueError(
                f"{what} {name!r} is not supported; expected one of bf16, fp16, fp32"
            ) from None
    if dtype not in STORAGE_DTYPES:
        raise ValueError(
            f"{what} {dtype} is not supported; expected torch.bfloat16, torch.float16 or torch.float32"
        )
    return dtype


def _invert(mapping: dict) -> dict:
    return {v: k for k, v in mapping.items()}


def dtype_short_name(dtype: torch.dtype) -> str:
    """``"fp32"``, ``"fp16"`` or ``"bf16"``: how compile specs, sidecars and options spell a dtype."""
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype_from_name(dtype)]


def check_growth_policy(initial_capacity: "int | None" = None, max_capacity: "int | None" = None,
                        growth_factor: "float | None" = None, rewind_budget: "int | None" = None,
                        capacity_limit: int = 2**31) -> None:
    """The growth policy's field ranges, for the export-time defaults and the
    load-time overrides alike (``None``: not given); raises ValueError naming
    the field. Capacities must be below ``capacity_limit`` (load-time overrides
    travel as ExecuTorch backend options, which hold an int). The runtime checks
    the same in ``GrowthPolicy::validate``."""
    for name, value in (("initial_capacity", initial_capacity), ("max_capacity", max_capacity),
                        ("rewind_budget", rewind_budget)):
        if value is not None and (isinstance(value, bool) or int(value) != value):
            raise ValueError(f"{name} must be a whole number, got {value!r}")
    for name, value in (("initial_capacity", initial_capacity), ("max_capacity", max_capacity)):
        if value is not None and not 1 <= int(value) < capacity_limit:
            raise ValueError(f"{name} must be in [1, {capacity_limit}), got {value}")
    if initial_capacity is not None and max_capacity is not None and int(initial_capacity) > int(max_capacity):
        raise ValueError(f"initial_capacity {initial_capacity} must be in [1, max_capacity={max_capacity}]")
    if growth_factor is not None and not (float(growth_factor) > 1.0 and math.isfinite(float(growth_factor))):
        raise ValueError(f"growth_factor must be a finite number > 1, got {growth_factor}")
    if rewind_budget is not None and not 0 <= int(rewind_budget) < 2**24:
        raise ValueError(f"rewind_budget must be in [0, 2**24), got {rewind_budget}")


def ring_slots(window: int, max_write: int, rewind_budget: int = 0) -> int:
    """Slots a ring layer keeps: a step of ``max_write`` tokens never evicts a
    position still inside the window, plus the rewind budget's. (The runtime's
    ``KVStore::rows_of`` is the same rule in C++.)"""
    return window + max_write - 1 + rewind_budget


@dataclass(frozen=True)
class PrivateTensor:
    """One runtime-bound tensor: a layer's K or V storage."""

    layer: int
    role: str  # "key" | "value"
    kind: str  # "flat" | "ring"
    window: int
    num_heads: int
    head_dim: int
    storage_dtype: torch.dtype
    compiled_input: int

    def bytes_per_row(self) -> int:
        return self.num_heads * self.head_dim * self.storage_dtype.itemsize


@dataclass(frozen=True)
class InputDim:
    kind: str    # "static" | "width" | "dynamic"
    extent: int  # static: the extent; dynamic: the upper bound (0: none); width: 0


@dataclass(frozen=True)
class UserInput:
    """One delegate input as compiled; the runtime rejects a step whose input differs."""

    dtype: torch.dtype
    dims: List[InputDim]

    def width_dims(self) -> List[int]:
        return [d for d, dim in enumerate(self.dims) if dim.kind == "width"]


@dataclass(frozen=True)
class WeightSpec:
    """One constant of the compiled code kept as named data (manifest version 3)."""

    name: str  # the AOTI container's constant name
    fqn: str
    data_key: str
    dtype: int  # c10::ScalarType code
    nbytes: int  # storage bytes
    sizes: Tuple[int, ...]
    strides: Tuple[int, ...]
    storage_offset: int = 0
    crc32: int = 0  # zlib.crc32 of the bytes, checked at load


@dataclass(frozen=True)
class CompiledInterface:
    """What the compiled code itself takes, recorded at export from the program
    AOTInductor compiled (not from the manifest): each input's dtype and sizes
    (-1 for an extent chosen at run time), the outputs, the width bound, and
    whether the constants are packaged in the code, whether the attention
    reads the length from device memory (extents are then only bounds), and
    each layer's ring window as compiled (0: flat)."""

    inputs: Tuple[Tuple[int, Tuple[int, ...]], ...]  # (c10 dtype code, sizes)
    num_outputs: int
    width_bound: int
    weights_in_code: bool
    lengths_from_device: bool = False
    ring_windows: Tuple[int, ...] = ()

    def to_bytes(self) -> bytes:
        import flatbuffers

        t = fb.CompiledInterfaceT()
        t.inputs = []
        for dtype, sizes in self.inputs:
            i = fb.CompiledInputT()
            i.dtype, i.sizes = dtype, list(sizes)
            t.inputs.append(i)
        t.numOutputs, t.widthBound, t.weightsInCode = self.num_outputs, self.width_bound, self.weights_in_code
        t.lengthsFromDevice = self.lengths_from_device
        t.ringWindows = list(self.ring_windows) if self.ring_windows else None
        builder = flatbuffers.Builder(256)
        builder.Finish(t.Pack(builder))
        return bytes(builder.Output())

    @classmethod
    def from_bytes(cls, data: bytes) -> "CompiledInterface":
        t = fb.CompiledInterfaceT.InitFromPackedBuf(bytearray(data), 0)
        inputs = tuple((i.dtype, tuple(int(x) for x in (i.sizes if i.sizes is not None else ()))) for i in t.inputs or ())
        windows = tuple(int(w) for w in t.ringWindows) if t.ringWindows is not None else ()
        return cls(inputs, t.numOutputs, t.widthBound, bool(t.weightsInCode), bool(t.lengthsFromDevice), windows)


@dataclass
class Manifest:
    device: str
    target: str
    num_user_inputs: int
    num_outputs: int
    max_write: int
    capacity_bound: int
    initial_capacity: int
    max_capacity: int
    growth_factor: float
    compiled_code_key: str
    tensors: List[PrivateTensor] = field(default_factory=list)
    batch: int = 1
    version: int = MANIFEST_VERSION
    length_input: "int | None" = None  # compiled input of the int64 [1] committed length (rings)
    inputs: List[UserInput] = field(default_factory=list)  # the delegate inputs, in args order
    width_bound: int = 0  # export bound of the step width
    rewind_budget: int = 0  # export default of the rings' extra slots
    weights: List[WeightSpec] = field(default_factory=list)  # weights outside the code (none: inside it)
    compiled_interface: bytes = b""  # CompiledInterface bytes, covered by the code's digest

    def kv_bytes_per_token(self) -> int:
        """Bytes one more token of context adds: the flat layers' K and V rows."""
        return sum(t.bytes_per_row() for t in self.tensors if t.kind == "flat")

    def ring_bytes(self, rewind_budget: "int | None" = None) -> int:
        """The ring layers' fixed K and V bytes, with the export's rewind budget
        unless another is given (a load-time option)."""
        budget = self.rewind_budget if rewind_budget is None else rewind_budget
        return sum(ring_slots(t.window, self.max_write, budget) * t.bytes_per_row()
                   for t in self.tensors if t.kind == "ring")

    def to_bytes(self) -> bytes:
        m = fb.ManifestT()
        m.version = self.version
        m.device = DEVICES[self.device]
        m.target = self.target
        m.layout = fb.Layout.SequenceMajor
        m.batch = self.batch
        m.numUserInputs = self.num_user_inputs
        m.numOutputs = self.num_outputs
        m.maxWrite = self.max_write
        m.capacityBound = self.capacity_bound
        m.initialCapacity = self.initial_capacity
        m.maxCapacity = self.max_capacity
        m.growthFactor = self.growth_factor
        m.compiledCodeKey = self.compiled_code_key
        m.hasLengthInput = self.length_input is not None
        m.lengthInput = self.length_input or 0
        m.widthBound = self.width_bound
        m.rewindBudget = self.rewind_budget
        m.inputs = []
        for u in self.inputs:
            i = fb.UserInputT()
            i.dtype = SCALAR_TYPES[u.dtype]
            i.dims = []
            for d in u.dims:
                dim = fb.InputDimT()
                dim.kind = DIM_KINDS[d.kind]
                dim.extent = d.extent
                i.dims.append(dim)
            m.inputs.append(i)
        m.tensors = []
        for t in self.tensors:
            p = fb.PrivateTensorT()
            p.layer = t.layer
            p.role = ROLES[t.role]
            p.kind = LAYER_KINDS[t.kind]
            p.window = t.window
            p.numHeads = t.num_heads
            p.headDim = t.head_dim
            p.storageDtype = STORAGE_DTYPES[t.storage_dtype]
            p.compiledInput = t.compiled_input
            m.tensors.append(p)
        m.weights = [_pack_weight(w) for w in self.weights]
        m.compiledInterface = list(self.compiled_interface)
        import flatbuffers

        builder = flatbuffers.Builder(256)
        builder.Finish(m.Pack(builder), file_identifier=FILE_IDENTIFIER)
        return bytes(builder.Output())

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        if len(data) < 8 or not fb.Manifest.ManifestBufferHasIdentifier(data, 0):
            raise ManifestError("not an offgraph-kv manifest (missing 'OGKV' identifier)")
        m = fb.ManifestT.InitFromPackedBuf(bytearray(data), 0)
        if m.version not in READABLE_VERSIONS:
            raise ManifestError(f"manifest version {m.version} is not supported (expected {MANIFEST_VERSION})")
        if m.target is None or m.compiledCodeKey is None or m.tensors is None or m.inputs is None:
            raise ManifestError("manifest lacks a required field (target, compiled_code_key, tensors or inputs)")
        dtypes, devices = _invert(STORAGE_DTYPES), _invert(DEVICES)
        scalar_types, dim_kinds = _invert(SCALAR_TYPES), _invert(DIM_KINDS)
        kinds, roles = _invert(LAYER_KINDS), _invert(ROLES)
        return cls(
            device=devices[m.device],
            target=m.target.decode(),
            num_user_inputs=m.numUserInputs,
            num_outputs=m.numOutputs,
            max_write=m.maxWrite,
            capacity_bound=m.capacityBound,
            initial_capacity=m.initialCapacity,
            max_capacity=m.maxCapacity,
            growth_factor=m.growthFactor,
            compiled_code_key=m.compiledCodeKey.decode(),
            batch=m.batch,
            version=m.version,
            length_input=m.lengthInput if m.hasLengthInput else None,
            width_bound=m.widthBound,
            rewind_budget=m.rewindBudget,
            inputs=[
                UserInput(scalar_types[u.dtype], [InputDim(dim_kinds[d.kind], d.extent) for d in u.dims])
                for u in m.inputs
            ],
            tensors=[
                PrivateTensor(
                    layer=p.layer,
                    role=roles[p.role],
                    kind=kinds[p.kind],
                    window=p.window,
                    num_heads=p.numHeads,
                    head_dim=p.headDim,
                    storage_dtype=dtypes[p.storageDtype],
                    compiled_input=p.compiledInput,
                )
                for p in m.tensors
            ],
            weights=[_unpack_weight(w) for w in (m.weights or [])],
            compiled_interface=bytes(m.compiledInterface if m.compiledInterface is not None else ()),
        )

    def interface(self) -> CompiledInterface:
        if not self.compiled_interface:
            raise ManifestError("manifest lacks the compiled interface (re-export with this version)")
        return CompiledInterface.from_bytes(self.compiled_interface)


def _pack_weight(w: WeightSpec) -> "fb.WeightT":
    t = fb.WeightT()
    t.name, t.fqn, t.dataKey = w.name, w.fqn, w.data_key
    t.dtype, t.nbytes, t.storageOffset = w.dtype, w.nbytes, w.storage_offset
    t.sizes, t.strides = list(w.sizes), list(w.strides)
    t.crc32 = w.crc32
    return t


def _unpack_weight(t: "fb.WeightT") -> WeightSpec:
    return WeightSpec(name=t.name.decode(), fqn=(t.fqn or b"").decode(), data_key=t.dataKey.decode(), dtype=t.dtype,
                      nbytes=t.nbytes, sizes=tuple(int(x) for x in (t.sizes if t.sizes is not None else ())),
                      strides=tuple(int(x) for x in (t.strides if t.strides is not None else ())),
                      storage_offset=t.storageOffset, crc32=t.crc32)
