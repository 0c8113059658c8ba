"""Python writer and reader of the payload-free manifest (``manifest.fbs``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import torch

from offgraph_kv.schemas import manifest_generated as fb

# Bump when a reader of the previous version could misread a new manifest.
MANIFEST_VERSION = 1
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


class ManifestError(ValueError):
    """A manifest that is malformed or disagrees with the program it describes."""


def dtype_from_name(name: "str | torch.dtype") -> torch.dtype:
    """Accept ``torch.bfloat16`` or a short name such as ``"bf16"``."""
    if isinstance(name, torch.dtype):
        dtype = name
    else:
        try:
            dtype = _DTYPE_NAMES[name.lower()]
        except KeyError:
            raise ValueError(
                f"storage_dtype {name!r} is not supported; expected one of bf16, fp16, fp32"
            ) from None
    if dtype not in STORAGE_DTYPES:
        raise ValueError(
            f"storage_dtype {dtype} is not supported; expected torch.bfloat16, torch.float16 or torch.float32"
        )
    return dtype


def _invert(mapping: dict) -> dict:
    return {v: k for k, v in mapping.items()}


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

    def kv_bytes_per_token(self) -> int:
        return sum(t.bytes_per_row() for t in self.tensors)

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
        import flatbuffers

        builder = flatbuffers.Builder(256)
        builder.Finish(m.Pack(builder), file_identifier=FILE_IDENTIFIER)
        return bytes(builder.Output())

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        if len(data) < 8 or not fb.Manifest.ManifestBufferHasIdentifier(data, 0):
            raise ManifestError("not an offgraph-kv manifest (missing 'OGKV' identifier)")
        m = fb.ManifestT.InitFromPackedBuf(bytearray(data), 0)
        if m.version != MANIFEST_VERSION:
            raise ManifestError(f"manifest version {m.version} is not supported (expected {MANIFEST_VERSION})")
        if m.target is None or m.compiledCodeKey is None or m.tensors is None:
            raise ManifestError("manifest lacks a required field (target, compiled_code_key or tensors)")
        dtypes, devices = _invert(STORAGE_DTYPES), _invert(DEVICES)
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
        )
