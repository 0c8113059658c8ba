"""Kernels of our own in CPU programs: the attention over the store's rows
(any step width), and the decode linears over the stored weights.

The ops (``offgraph_kv::rows_attend_causal``, ``rows_attend_with_lse``, ``linear_rows``,
``int8_linear_rows``, ``int4_linear_rows``, ``int4z_linear_rows``,
``int4_da8_linear_rows``, ``int8_da8_linear_rows``) stay whole
through export. AOTInductor then calls each as a C function
(``aot_inductor.custom_ops_to_c_shims``), whose code (``native/*.cpp``) is
compiled here with the ISA flags of inductor's own kernels and linked into the
program's shared object, so the .pte carries it: the runtime loads that object
``RTLD_LOCAL`` with nothing else to resolve it from. Eager runs of the ops
(references, an exported program run in Python) take the same arithmetic
written in torch.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List

import torch

SOURCES = tuple(Path(__file__).parent / "native" / n
                for n in ("rows_attention.cpp", "decode_linear.cpp", "dynamic_linear.cpp"))
HEADERS = tuple(Path(__file__).parent / "native" / n
                for n in ("float16.h", "linear_call.h", "shared_rows.h", "shim_view.h", "vec.h", "wide_rows.h"))  # included besides torch's

_LIB = torch.library.Library("offgraph_kv", "FRAGMENT")
_LIB.define("rows_attend_with_lse(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)")
# A flat layer's whole step: q [1, H_kv, groups * T, D] (row g * T + i) over the S stored rows, the
# step's own the last T, lower-right causal (query i sees rows 0 .. S - T + i).
_LIB.define("rows_attend_causal(Tensor q, Tensor k, Tensor v, float scale, int groups) -> Tensor")
# The decode linears: x [R, K] (fp32, bf16 or fp16) -> [R, N] of x's dtype, fp32 accumulation.
_LIB.define("linear_rows(Tensor x, Tensor w) -> Tensor")
_LIB.define("int8_linear_rows(Tensor x, Tensor qdata, Tensor scale) -> Tensor")
_LIB.define("int4_linear_rows(Tensor x, Tensor packed, Tensor scale) -> Tensor")
_LIB.define("int4z_linear_rows(Tensor x, Tensor packed, Tensor scale, Tensor zero) -> Tensor")
# int8 dynamic activations x int4 / int8 weights in tiles (quantized_linear.pack_int4_tiles /
# pack_int8_tiles), any row count.
_LIB.define("int4_da8_linear_rows(Tensor x, Tensor packed, Tensor scale, Tensor rowsum) -> Tensor")
_LIB.define("int8_da8_linear_rows(Tensor x, Tensor packed, Tensor scale, Tensor wsum) -> Tensor")

# The C declaration of each op that AOTInductor's generated code calls (outputs returned as new handles).
_H = "AtenTensorHandle"
C_SHIMS = {
    "rows_attend_with_lse": f"AOTITorchError aoti_torch_cpu_rows_attend_with_lse({_H} q, {_H} k, {_H} v, "
                            f"double scale, {_H}* ret0, {_H}* ret1)",
    "rows_attend_causal": f"AOTITorchError aoti_torch_cpu_rows_attend_causal({_H} q, {_H} k, {_H} v, "
                          f"double scale, int64_t groups, {_H}* ret0)",
    "linear_rows": f"AOTITorchError aoti_torch_cpu_linear_rows({_H} x, {_H} w, {_H}* ret0)",
    "int8_linear_rows": f"AOTITorchError aoti_torch_cpu_int8_linear_rows({_H} x, {_H} q, {_H} scale, {_H}* ret0)",
    "int4_linear_rows": f"AOTITorchError aoti_torch_cpu_int4_linear_rows({_H} x, {_H} packed, {_H} scale, "
                        f"{_H}* ret0)",
    "int4z_linear_rows": f"AOTITorchError aoti_torch_cpu_int4z_linear_rows({_H} x, {_H} packed, {_H} scale, "
                         f"{_H} zero, {_H}* ret0)",
    "int4_da8_linear_rows": f"AOTITorchError aoti_torch_cpu_int4_da8_linear_rows({_H} x, {_H} packed, "
                            f"{_H} scale, {_H} rowsum, {_H}* ret0)",
    "int8_da8_linear_rows": f"AOTITorchError aoti_torch_cpu_int8_da8_linear_rows({_H} x, {_H} packed, "
                            f"{_H} scale, {_H} wsum, {_H}* ret0)",
}


def rows_attend_with_lse_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   scale: float) -> "tuple[torch.Tensor, torch.Tensor]":
    """What the kernel computes: queries ``[1, H_kv, R, D]`` (fp32) over all
    ``S`` rows of ``k``, ``v`` ``[1, H_kv, S, D]``, unmasked, in fp32; the fp32
    output ``[1, H_kv, R, Dv]`` and each query row's log-sum-exp, contiguous."""
    from offgraph_kv.backend.attention import _explicit_attention  # attention.py imports this module

    out, lse = _explicit_attention(q.float(), k, v, scale)
    return out.contiguous(), lse.contiguous()


_LIB.impl("rows_attend_with_lse", rows_attend_with_lse_reference, "CompositeExplicitAutograd")


def causal_mask(rows: int, t: int, groups: int) -> torch.Tensor:
    """``[groups * t, rows]``: query row ``g * t + i`` sees stored rows ``0 .. rows - t + i``."""
    i = torch.arange(groups * t) % t
    return torch.arange(rows).unsqueeze(0) <= (rows - t + i).unsqueeze(1)


def rows_attend_causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                                 groups: int) -> torch.Tensor:
    """What the kernel computes: queries ``[1, H_kv, groups * T, D]`` over ``k``, ``v``
    ``[1, H_kv, S, D]`` (the step's rows the last ``T``), lower-right causal, in fp32;
    the fp32 output ``[1, H_kv, groups * T, Dv]``, contiguous."""
    from offgraph_kv.backend.attention import _explicit_attention  # attention.py imports this module

    mask = causal_mask(k.shape[2], q.shape[2] // groups, groups).to(q.device)
    return _explicit_attention(q.float(), k, v, scale, mask)[0].contiguous()


_LIB.impl("rows_attend_causal", rows_attend_causal_reference, "CompositeExplicitAutograd")
torch.library.register_fake("offgraph_kv::rows_attend_causal")(
    lambda q, k, v, scale, groups: q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=torch.float32))


@torch.library.register_fake("offgraph_kv::rows_attend_with_lse")
def _rows_attend_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):  # noqa: ANN202
    b, h, r, _ = q.shape
    return (q.new_empty((b, h, r, v.shape[-1]), dtype=torch.float32),
            q.new_empty((b, h, r), dtype=torch.float32))


# Eager forms of the linears: the references the kernels are checked against (imported when
# first run: quantized_linear and decode_gemv import this module).
def _linear_rows_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float().unsqueeze(1) * w.float().unsqueeze(0)).sum(-1).to(x.dtype)


def _int8_rows_reference(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from offgraph_kv.backend.quantized_linear import int8_one_row

    return int8_one_row(x, qdata, scale)


def _int4_rows_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from offgraph_kv.backend.quantized_linear import int4_one_row

    return int4_one_row(x, packed, scale, None)


def _int4z_rows_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                          zero: torch.Tensor) -> torch.Tensor:
    from offgraph_kv.backend.quantized_linear import int4_one_row

    return int4_one_row(x, packed, scale, zero)


def _int4_da8_rows_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                             rowsum: torch.Tensor) -> torch.Tensor:
    from offgraph_kv.backend.quantized_linear import int4_da8_integer_rows

    return int4_da8_integer_rows(x, packed, scale, rowsum)


def _int8_da8_rows_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                             wsum: torch.Tensor) -> torch.Tensor:
    from offgraph_kv.backend.quantized_linear import int8_da8_integer_rows

    return int8_da8_integer_rows(x, packed, scale, wsum)


for _name, _ref in (("linear_rows", _linear_rows_reference), ("int8_linear_rows", _int8_rows_reference),
                    ("int4_linear_rows", _int4_rows_reference), ("int4z_linear_rows", _int4z_rows_reference),
                    ("int4_da8_linear_rows", _int4_da8_rows_reference),
                    ("int8_da8_linear_rows", _int8_da8_rows_reference)):
    _LIB.impl(_name, _ref, "CompositeExplicitAutograd")


def _rows_out(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], n))


torch.library.register_fake("offgraph_kv::linear_rows")(lambda x, w: _rows_out(x, w.shape[0]))
torch.library.register_fake("offgraph_kv::int8_linear_rows")(lambda x, q, s: _rows_out(x, q.shape[0]))
torch.library.register_fake("offgraph_kv::int4_linear_rows")(lambda x, p, s: _rows_out(x, p.shape[0]))
torch.library.register_fake("offgraph_kv::int4z_linear_rows")(lambda x, p, s, z: _rows_out(x, p.shape[0]))
torch.library.register_fake("offgraph_kv::int4_da8_linear_rows")(lambda x, p, s, r: _rows_out(x, r.shape[0]))
torch.library.register_fake("offgraph_kv::int8_da8_linear_rows")(lambda x, p, s, w: _rows_out(x, w.shape[0]))


def shim_options() -> Dict[str, object]:
    """AOTInductor options that make the generated code call our kernels by name."""
    ops = torch.ops.offgraph_kv
    return {"aot_inductor.custom_ops_to_c_shims": {getattr(ops, n).default: [c] for n, c in C_SHIMS.items()}}


def _compile_flags() -> List[str]:
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    include = os.path.join(os.path.dirname(torch.__file__), "include")
    # The ISA of inductor's kernels, no more: the manifest's target names it, and the
    # runtime checks the loading machine against that (aoti_compile.target_of).
    isa = pick_vec_isa().build_arch_flags().split()
    return ["-O3", "-fPIC", "-std=c++17", "-fopenmp", "-fno-gnu-unique", "-DNDEBUG", *isa, "-I", include]


def _run(command: List[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-4000:]}")


def build_object(cache_dir: str, compiler: str = "g++") -> str:
    """The kernels' one object file (each source compiled, then linked into one
    relocatable object), built once per sources, flags and compiler."""
    flags = _compile_flags()
    digest = hashlib.sha256("\0".join([compiler, *flags]).encode())
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    directory = os.path.join(cache_dir, "offgraph_kv_native")
    os.makedirs(directory, exist_ok=True)
    obj = os.path.join(directory, f"kernels_{digest.hexdigest()[:24]}.o")
    if os.path.exists(obj):
        return obj
    with tempfile.TemporaryDirectory(dir=directory) as work:
        parts = [os.path.join(work, f"{s.stem}.o") for s in SOURCES]
        for source, part in zip(SOURCES, parts):
            _run([compiler, "-c", str(source), "-o", part, *flags], f"compiling {source.name}")
        joined = os.path.join(work, "kernels.o")
        _run([compiler, "-r", "-nostdlib", "-o", joined, *parts], "linking the kernels' objects")
        os.replace(joined, obj)  # a concurrent build never links a half-written object
    return obj
