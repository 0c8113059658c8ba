"""A bounded walk over a GGUF file's header, metadata and tensor-info table, before ``gguf.GGUFReader`` runs.

The reader trusts every count and length it reads: one flipped type byte turns a
string's bytes into an array length, and it then builds an object per "element"
(more than 6 GB for the 98 MB SmolLM2 file). This walk reads the same layout with
every length checked against the bytes left in the file and the number of entries
the reader would build bounded, so damage is named (key or tensor, offset, what was
expected) before the reader allocates anything. The rules are llama.cpp's own
(gguf.cpp): known value types, UTF-8 keys and strings, no duplicate keys or tensor
names, at most 4 dimensions, known tensor types whose rows hold whole blocks.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

# GGUF value types (gguf.GGUFValueType): the bytes a scalar takes.
_SCALAR_SIZES: Dict[int, int] = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_TYPE_NAMES = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32", 7: "BOOL",
               8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64"}
# The fewest bytes one value of a type takes (a string: its u64 length; an array: item type + u64 length).
_MIN_SIZES = {**_SCALAR_SIZES, _STRING: 8, _ARRAY: 12}
READER_VERSIONS = (2, 3)  # what gguf.GGUFReader reads (version 1 counted with u32s)
# llama.cpp's limits: GGML_MAX_DIMS, GGML_MAX_NAME (the name and its NUL).
MAX_DIMS = 4
MAX_TENSOR_NAME = 63
# Arrays hold arrays at most this deep (llama.cpp reads none; gguf's writer can write one level).
MAX_NESTING = 2
# gguf.GGUFReader keeps a numpy view per array entry (two per string): measured ~0.7 KB and ~60 us
# each (gguf 0.19, 2 cores), so this bounds it near 1.5 GB and two minutes. Real vocabularies need
# ~0.25M (SmolLM2) to ~1.3M (Gemma 3's 262k tokens with scores and types; Llama 3's with merges ~0.95M).
MAX_READER_ENTRIES = 1 << 21
MAX_KEY_LENGTH = 1 << 16  # the longest llama.cpp key is under 100 bytes


@dataclass
class ScannedTensor:
    """One tensor-info entry as the scan read it."""

    name: str
    dims: Tuple[int, ...]  # GGUF order: fastest-varying first
    ggml_type: int
    offset: int  # from the start of the data section
    n_bytes: int


@dataclass
class GGUFScan:
    """What the scan established: the layout gguf.GGUFReader will read."""

    version: int
    value_types: Dict[str, Tuple[int, ...]]  # key -> (type, item type...) as stored
    tensors: List[ScannedTensor]
    alignment: int
    data_offset: int


class _Walker:
    """Reads values at a moving offset; every read is checked against the file's end."""

    def __init__(self, path: Path, data: "mmap.mmap | bytes", order: str) -> None:
        self.path, self.data, self.order, self.size = path, data, order, len(data)
        self.offs = 0
        self.entries = 0  # views gguf.GGUFReader will build for array entries

    def fail(self, what: str, at: int) -> ValueError:
        return ValueError(f"{self.path} is not a readable GGUF file: {what} (at byte {at} of {self.size})")

    def left(self) -> int:
        return self.size - self.offs

    def take(self, n: int, what: str) -> bytes:
        if n > self.left():
            raise self.fail(f"{what} needs {n} bytes, {self.left()} are left", self.offs)
        out = bytes(self.data[self.offs:self.offs + n])
        self.offs += n
        return out

    def uint(self, size: int, what: str) -> int:
        return int.from_bytes(self.take(size, what), "little" if self.order == "<" else "big")

    def string(self, what: str, limit: int) -> bytes:
        at = self.offs
        n = self.uint(8, f"the length of {what}")
        if n > min(limit, self.left()):
            beyond = f"more than the {limit} allowed" if n > limit else "past the end of the file"
            raise self.fail(f"{what} states a length of {n} bytes, {beyond}", at)
        return self.take(n, what)

    def text(self, what: str, limit: int) -> str:
        at = self.offs
        raw = self.string(what, limit)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8 text", at) from None

    def value(self, vtype: int, what: str, depth: int) -> Tuple[int, ...]:
        """Skip one value of ``vtype``; returns its type chain (ARRAY, item type, ...)."""
        at = self.offs
        if vtype in _SCALAR_SIZES:
            self.take(_SCALAR_SIZES[vtype], what)
            return (vtype,)
        if vtype == _STRING:
            self.text(what, self.size)
            return (vtype,)
        if vtype != _ARRAY:
            raise self.fail(f"{what} has value type {vtype}, not a GGUF type (0-12)", at - 4)
        if depth >= MAX_NESTING:
            raise self.fail(f"{what} nests arrays more than {MAX_NESTING} deep", at)
        itype = self.uint(4, f"the item type of {what}")
        if itype not in _MIN_SIZES:
            raise self.fail(f"{what} is an array of type {itype}, not a GGUF type (0-12)", at)
        count = self.uint(8, f"the length of {what}")
        if count * _MIN_SIZES[itype] > self.left():
            raise self.fail(f"{what} states {count} entries of {_TYPE_NAMES[itype]} "
                            f"({_MIN_SIZES[itype]}+ bytes each), only {self.left()} bytes are left", at)
        self.entries += count * (2 if itype == _STRING else 1)
        if self.entries > MAX_READER_ENTRIES:
            raise self.fail(f"{what} brings the metadata's array entries to {self.entries}, more than the "
                            f"{MAX_READER_ENTRIES} the reader is allowed to build", at)
        if itype in _SCALAR_SIZES:  # fixed size: checked above, skipped at once
            self.offs += count * _SCALAR_SIZES[itype]
            return (vtype, itype)
        chain: Tuple[int, ...] = (vtype, itype)
        for i in range(count):
            chain = (vtype,) + self.value(itype, f"{what}[{i}]", depth + 1)
        return chain


def scan_gguf(path: "str | Path") -> GGUFScan:
    """Walk ``path``'s header, metadata and tensor-info table; a ValueError names the first damage."""
    path = Path(path)
    with open(path, "rb") as fh:
        size = path.stat().st_size
        if size < 24:
            raise ValueError(f"{path} is not a readable GGUF file: {size} bytes, shorter than a GGUF header (24)")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _scan(path, data)


def _scan(path: Path, data: mmap.mmap) -> GGUFScan:
    if data[:4] != b"GGUF":
        raise ValueError(f"{path} is not a readable GGUF file: magic {bytes(data[:4])!r}, expected b'GGUF'")
    # As gguf.GGUFReader decides: a version whose low 16 bits are zero was written on the other byte order.
    (version,) = struct.unpack_from("<I", data, 4)
    order = "<"
    if version & 0xFFFF == 0:
        order = ">"
        (version,) = struct.unpack_from(">I", data, 4)
    if version not in READER_VERSIONS:
        raise ValueError(f"{path} is not a readable GGUF file: version {version}, "
                         f"expected one of {READER_VERSIONS}")
    w = _Walker(path, data, order)
    w.offs = 8
    tensor_count = w.uint(8, "the tensor count")
    kv_count = w.uint(8, "the metadata count")
    if kv_count * (8 + 4 + 1) > w.left():  # a key's length, its type, a 1-byte value at least
        raise w.fail(f"the header states {kv_count} metadata entries, the file has room for at most "
                     f"{w.left() // 13}", 16)
    if tensor_count * (8 + 4 + 4 + 8) > w.left():  # name length, n_dims, type, offset at least
        raise w.fail(f"the header states {tensor_count} tensors, the file has room for at most {w.left() // 24}", 8)

    value_types: Dict[str, Tuple[int, ...]] = {}
    value_at: Dict[str, int] = {}
    prev = ""
    for i in range(kv_count):
        at = w.offs
        # Damage in one value shows at the next key: name the key before it too.
        key = w.text(f"metadata key #{i}" + (f" (the entry after {prev!r})" if prev else ""), MAX_KEY_LENGTH)
        prev = key
        if key in value_types:
            raise w.fail(f"metadata key {key!r} appears twice", at)
        vtype = w.uint(4, f"the value type of metadata key {key!r}")
        if vtype not in _MIN_SIZES:
            raise w.fail(f"metadata key {key!r} has value type {vtype}, not a GGUF type (0-12)", w.offs - 4)
        value_at[key] = w.offs
        value_types[key] = w.value(vtype, f"the value of metadata key {key!r}", 0)

    infos: List[Tuple[str, Tuple[int, ...], int, int, int]] = []
    names = set()
    for i in range(tensor_count):
        at = w.offs
        name = w.text(f"the name of tensor #{i}", MAX_TENSOR_NAME)
        if name in names:
            raise w.fail(f"tensor {name!r} appears twice in the tensor-info table", at)
        names.add(name)
        n_dims = w.uint(4, f"the dimension count of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise w.fail(f"tensor {name!r} states {n_dims} dimensions, at most {MAX_DIMS}", w.offs - 4)
        dims = tuple(w.uint(8, f"dimension {d} of tensor {name!r}") for d in range(n_dims))
        ggml_type = w.uint(4, f"the type of tensor {name!r}")
        offset = w.uint(8, f"the data offset of tensor {name!r}")
        infos.append((name, dims, ggml_type, offset, at))

    alignment = 32  # GGUF_DEFAULT_ALIGNMENT
    if "general.alignment" in value_types:
        if value_types["general.alignment"] != (4,):
            raise ValueError(f"{path} is not a readable GGUF file: metadata 'general.alignment' must be UINT32, "
                             f"got {_chain_name(value_types['general.alignment'])}")
        (alignment,) = struct.unpack_from(order + "I", data, value_at["general.alignment"])
        if alignment == 0 or alignment & (alignment - 1):
            raise ValueError(f"{path} is not a readable GGUF file: metadata 'general.alignment' is {alignment}, "
                             "not a power of two")
    data_offset = -(-w.offs // alignment) * alignment
    data_bytes = max(len(data) - data_offset, 0)
    tensors = [_tensor(w, data_bytes, *info) for info in infos]
    return GGUFScan(version, value_types, tensors, alignment, data_offset)


def _tensor(w: _Walker, data_bytes: int, name: str, dims: Tuple[int, ...], ggml_type: int, offset: int,
            at: int) -> ScannedTensor:
    """One tensor's entry checked: a known type, whole blocks per row, and data inside the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # optional package, as gguf_import's

    try:
        qtype = GGMLQuantizationType(ggml_type)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise w.fail(f"tensor {name!r} has type {ggml_type}, not a GGML tensor type", at) from None
    if dims and dims[0] % block:
        raise w.fail(f"tensor {name!r} has rows of {dims[0]} values, not whole {qtype.name} blocks of {block}", at)
    n_elements = 1
    for d in dims:
        n_elements *= d  # Python integers: no overflow to hide a huge product
    n_bytes = n_elements // block * block_bytes
    if offset + n_bytes > data_bytes:
        raise w.fail(f"tensor {name!r} ({'x'.join(map(str, dims)) or 'scalar'} {qtype.name}, {n_bytes} bytes at "
                     f"data offset {offset}) reaches past the {data_bytes} bytes of tensor data", at)
    return ScannedTensor(name, dims, ggml_type, offset, n_bytes)


def _chain_name(chain: Tuple[int, ...]) -> str:
    """A stored type chain in words: ARRAY of STRING, UINT32, ..."""
    return " of ".join(_TYPE_NAMES.get(t, str(t)) for t in chain)
