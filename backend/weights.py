"""Weights outside the compiled code.

AOTInductor can compile a program whose shared object holds no weights
(``aot_inductor.package_constants_in_so=False``): the container then starts
with an empty constant table and expects the host to supply every constant by
its container name. We store each constant's bytes as ExecuTorch named data in
the .pte (64-byte aligned, content-keyed) and describe it in the manifest
(container name, dtype, bytes, geometry). At init the delegate takes each one
from the program's NamedDataMap, which ``executorch.runtime`` and the C++
``Module`` back with a read-only mmap of the file, and hands the mapped bytes to
the container as user-managed tensors: on CPU nothing is copied (RSS is the
pages the code touches, at most the weight bytes once), on CUDA each weight is
copied once into one device arena. Each weight carries a CRC-32 that the
delegate checks at load (a flipped byte in the file is an error naming the
weight, never different logits): CRC-32 rather than the SHA-256 that keys
the data, because it runs at memory speed where SHA-256 would add seconds to
loading a multi-GB model.

Why named data in the .pte rather than a separate .ptd or AOTI's own blob
formats: one file stays the one artifact (as before), ExecuTorch's loaders
already mmap it; AOTI's ``binary_blob`` path copies into its own allocation
(``update_constants_from_blob`` re-runs ``load_constants``) and its
``pickle_weights`` path needs torch's Python loader. A weight-sharing .ptd can
come later through ``NamedDataStore``'s external tag without changing the
runtime: the NamedDataMap hides where the bytes live.

This module runs in two places: ``collect_weights`` in the compile
subprocess (it sees the compiled .so and the program it was compiled from) and
``add_weights_to_store`` in the exporting process (memory-light: every weight
stays in its file until the .pte is written).
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import tempfile
import zlib
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from offgraph_kv.schemas.manifest import SCALAR_TYPES, WeightSpec

# Alignment of each weight's bytes in the .pte. The mmapped pointer keeps the
# file offset's alignment modulo the page size, so this is the pointer's
# alignment at run time: AOTI packs constants 64-byte aligned in its own blob,
# and its CPU kernels may assume as much (AVX-512 vectors).
WEIGHT_ALIGNMENT = 64

# c10::ScalarType codes: what the container reports for each constant's dtype.
SCALAR_TYPE_CODES: Dict[torch.dtype, int] = SCALAR_TYPES


class WeightError(ValueError):
    """A compiled constant the export cannot place outside the code."""


@dataclass(frozen=True)
class CollectedWeight:
    """One constant of the compiled code, as the compile subprocess wrote it."""

    spec: WeightSpec
    path: str  # raw storage bytes
    sha256: bytes


def weights_in_code_requested() -> bool:
    """``OFFGRAPH_KV_WEIGHTS_IN_CODE=1`` compiles the weights into the shared
    object as before (manifest version 1): for side-by-side measurements only;
    such programs stop loading past ~2 GB."""
    return os.environ.get("OFFGRAPH_KV_WEIGHTS_IN_CODE") == "1"


def check_weights_are_read_only(program: "torch.export.ExportedProgram") -> None:
    """Weights are mapped read-only from the file: the compiled code must never write one."""
    mutated = sorted(program.graph_signature.buffers_to_mutate.values())
    if mutated:
        raise WeightError(f"the program writes its buffers {mutated[:4]}: weights outside the compiled code are mapped "
                          "read-only from the .pte")


def _runner(so_path: str, device: str) -> object:
    if device == "cuda":
        return torch._C._aoti.AOTIModelContainerRunnerCuda(so_path, 1, "cuda")
    return torch._C._aoti.AOTIModelContainerRunnerCpu(so_path, 1)


def _lookup(module: torch.nn.Module, fqn: str) -> "torch.Tensor | None":
    try:
        value = operator.attrgetter(fqn)(module)
    except AttributeError:
        return None
    return value if isinstance(value, torch.Tensor) else None


def _write_storage(t: torch.Tensor, path: str) -> Tuple[int, bytes, int]:
    """The tensor's whole storage (AOTI's unit: offset and strides index into it)."""
    storage = t.untyped_storage()
    if storage.device.type != "cpu":
        storage = storage.cpu()
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    digest = hashlib.sha256()
    crc = 0
    with open(path, "wb") as f:
        step = 64 << 20  # bounded memory for multi-GB weights
        for start in range(0, raw.numel(), step):
            chunk = raw[start:start + step].numpy().tobytes()
            digest.update(chunk)
            crc = zlib.crc32(chunk, crc)
            f.write(chunk)
    return raw.numel(), digest.digest(), crc


def _storage_key(t: torch.Tensor) -> "Tuple[int, int, Tuple[int, ...], Tuple[int, ...], torch.dtype] | None":
    if t.layout != torch.strided:
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def collect_weights(so_path: str, device: str, module: torch.nn.Module, outdir: str,
                    weights_dir: "str | None" = None, derived: "Dict[str, torch.Tensor] | None" = None) -> str:
    """In the compile subprocess: write every constant the compiled code expects.

    Names, FQNs and dtypes come from the container itself (torch's runner); the
    bytes and geometry from the module it was compiled from, where the FQN
    names them. ``derived`` holds the compiled graph's own constants by
    container name: with freezing, a parameter becomes ``_frozen_paramN`` (its
    FQN is then recovered from the module tensor it is) and the GEMM template's
    packed weights are new tensors (recorded under their container name).
    Returns the path of an index (JSON) that ``load_collected`` reads.
    """
    runner = _runner(so_path, device)
    fqns: Dict[str, str] = runner.get_constant_names_to_original_fqns()
    dtypes: Dict[str, int] = runner.get_constant_names_to_dtypes()
    weights_dir = weights_dir or tempfile.gettempdir()
    derived = derived or {}
    fqn_of = {}
    for n, p in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        fqn_of.setdefault(_storage_key(p), n)
    index = []
    for name, fqn in sorted(fqns.items()):
        t = _lookup(module, fqn)
        if t is None and name in derived:
            t = derived[name]
            if t.layout != torch.strided:
                raise WeightError(f"compiled constant {name!r} is an opaque {t.layout} tensor (oneDNN's packed "
                                  "weights: cpp.weight_prepack), which cannot be bound from the file's bytes")
            # A packed weight has no FQN, and AOTI reports one for several of them
            # ('constant4' for constant4_0, constant4_1, ...): its own name is the unique one.
            fqn = fqn_of.get(_storage_key(t), name)
        if t is None:
            raise WeightError(f"compiled constant {name!r} (from {fqn!r}) is not a tensor of the compiled program")
        code = SCALAR_TYPE_CODES.get(t.dtype)
        if code is None or code != dtypes.get(name):
            raise WeightError(f"compiled constant {name!r} ({fqn}): dtype {t.dtype} does not match the container's "
                              f"code {dtypes.get(name)}")
        # Outside the compile's work directory, which is removed after the
        # compile: the exporting process adopts these files (FileBackedData).
        fd, path = tempfile.mkstemp(prefix="offgraph_kv_weight_", suffix=".bin", dir=weights_dir)
        os.close(fd)
        nbytes, sha, crc = _write_storage(t, path)
        index.append({
            "name": name, "fqn": fqn, "dtype": code, "nbytes": nbytes, "sizes": list(t.shape),
            "strides": list(t.stride()), "storage_offset": int(t.storage_offset()), "path": path,
            "sha256": sha.hex(), "crc32": crc,
        })
    index_path = os.path.join(outdir, "weights.json")
    with open(index_path, "w") as f:
        json.dump(index, f)
    return index_path


def load_collected(index_path: str) -> List[CollectedWeight]:
    """The compile subprocess's weights, keyed by content."""
    with open(index_path) as f:
        index = json.load(f)
    out = []
    for e in index:
        sha = bytes.fromhex(e["sha256"])
        # Content-keyed: identical weights of two delegates (or two methods)
        # share one copy in the file, and distinct ones can never collide.
        key = "offgraph_kv_w_" + sha.hex()[:40]
        spec = WeightSpec(name=e["name"], fqn=e["fqn"], data_key=key, dtype=e["dtype"], nbytes=e["nbytes"],
                          sizes=tuple(e["sizes"]), strides=tuple(e["strides"]), storage_offset=e["storage_offset"],
                          crc32=e["crc32"])
        out.append(CollectedWeight(spec=spec, path=e["path"], sha256=sha))
    return out


def add_weights_to_store(weights: List[CollectedWeight], store: "object") -> int:
    """Add each weight to ``store`` (a NamedDataStore) from its file; returns the bytes added.

    The files move into ExecuTorch's file-backed buffers: the exporting process
    never holds the weights in memory a second time.
    """
    from executorch.exir._serialize._cord import FileBackedData

    total = 0
    for w in weights:
        store.add_named_data(w.spec.data_key, FileBackedData.move_from(w.path, sha256=w.sha256), WEIGHT_ALIGNMENT, None)
        total += w.spec.nbytes
    return total
