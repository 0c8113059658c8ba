"""GGUF files of one checkpoint at other tensor types, written with llama.cpp's own ``gguf`` package.

    python -m benchmarks.lib.gguf_requant SRC.gguf OUT.gguf Q8_0

The peer benchmark compares llama.cpp and offgraph-kv on the same weights, so
llama.cpp's files come from the checkpoint offgraph-kv imports: every tensor of
``SRC`` is dequantized to float32 (``gguf.quants.dequantize``) and written at
the target type (``gguf.quants.quantize``); the metadata, tokenizer included,
is copied field by field. One-dimensional tensors (the RMSNorm weights) stay
F32, as llama.cpp's own quantizer keeps them. Every two-dimensional tensor,
the token embedding too (SmolLM2 ties it to the output layer), takes the
target type: llama-quantize would give a tied embedding Q6_K in a Q4_0 file,
but the ``gguf`` package cannot write K-quants, and a uniform type is what the
int8 / int4 programs it is compared with have (their linears, the output
layer included, are all int8 / int4).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict

import numpy as np

# What each target is called in llama.cpp's file-type metadata (``general.file_type``).
FILE_TYPES = {"F32": "ALL_F32", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0"}
# Fields the writer sets itself (header counts, architecture) or that describe the old file.
_SKIP_FIELDS = ("GGUF.", "general.architecture", "general.file_type")


def _copy_metadata(reader: "object", writer: "object") -> int:
    """Copy every metadata field of ``reader`` into ``writer`` with its own value type; returns how many."""
    from gguf import GGUFValueType

    n = 0
    for key, field in reader.fields.items():
        if key.startswith(_SKIP_FIELDS):
            continue
        vtype = field.types[0]
        # Arrays keep their element type (token types are INT32, scores FLOAT32): inferred types could differ.
        sub = field.types[1] if vtype == GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
        n += 1
    return n


def requantize(src: "str | Path", out: "str | Path", target: str) -> Dict[str, object]:
    """Write ``out``: ``src``'s metadata and tensors, 2-D tensors at ``target`` (F32, BF16, Q8_0, Q4_0)."""
    import gguf

    if target not in FILE_TYPES:
        raise ValueError(f"target {target!r}: expected one of {', '.join(FILE_TYPES)}")
    qtype = gguf.GGMLQuantizationType[target]
    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    out = Path(out)
    tmp = out.with_suffix(out.suffix + ".part")  # a run cut short never leaves a file that looks finished
    writer = gguf.GGUFWriter(str(tmp), arch)
    fields = _copy_metadata(reader, writer)
    writer.add_file_type(int(gguf.LlamaFileType[FILE_TYPES[target]]))
    types: Dict[str, int] = {}
    max_err = 0.0
    for t in reader.tensors:
        # ggml lists dimensions fastest first; numpy wants them slowest first.
        shape = tuple(int(d) for d in reversed(t.shape))
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        to = qtype if len(shape) >= 2 else gguf.GGMLQuantizationType.F32
        data = gguf.quants.quantize(values, to)
        if to != gguf.GGMLQuantizationType.F32:
            # The byte array's shape says nothing of the element shape: name the type, the writer derives it.
            writer.add_tensor(t.name, data, raw_dtype=to)
            back = gguf.quants.dequantize(data, to).reshape(shape)
            max_err = max(max_err, float(np.abs(back - values).max()))
        else:
            writer.add_tensor(t.name, np.ascontiguousarray(data))
        types[to.name] = types.get(to.name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return {"path": str(out), "target": target, "bytes": out.stat().st_size, "metadata_fields": fields,
            "tensor_types": types, "max_abs_requant_error": max_err, "source": str(src)}


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("target", choices=sorted(FILE_TYPES))
    a = p.parse_args(argv)
    print(requantize(a.src, a.out, a.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
