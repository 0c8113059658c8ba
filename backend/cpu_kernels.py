"""Kernels of our own in CPU programs: the decode attention over the store's rows.

``offgraph_kv::rows_attend_with_lse`` stays whole through export. AOTInductor
then calls it as a C function (``aot_inductor.custom_ops_to_c_shims``), whose
code (``native/decode_attention.cpp``) is compiled here with the ISA flags of
inductor's own kernels and linked into the program's shared object, so the
.pte carries it: the runtime loads that object ``RTLD_LOCAL`` with nothing else
to resolve it from. Eager runs of the op (references, an exported program run
in Python) take the same arithmetic written in torch.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List

import torch

SOURCE = Path(__file__).parent / "native" / "decode_attention.cpp"
# The C declaration AOTInductor's generated code calls (outputs returned as new handles).
C_SHIM = ("AOTITorchError aoti_torch_cpu_rows_attend_with_lse(AtenTensorHandle q, AtenTensorHandle k, "
          "AtenTensorHandle v, double scale, AtenTensorHandle* ret0, AtenTensorHandle* ret1)")

_LIB = torch.library.Library("offgraph_kv", "FRAGMENT")
_LIB.define("rows_attend_with_lse(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)")


def rows_attend_with_lse_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   scale: float) -> "tuple[torch.Tensor, torch.Tensor]":
    """What the kernel computes: queries ``[1, H_kv, R, D]`` (fp32) over all
    ``S`` rows of ``k``, ``v`` ``[1, H_kv, S, D]``, unmasked, in fp32; the fp32
    output ``[1, H_kv, R, Dv]`` and each query row's log-sum-exp, contiguous."""
    from offgraph_kv.backend.attention import _explicit_attention  # attention.py imports this module

    out, lse = _explicit_attention(q.float(), k, v, scale)
    return out.contiguous(), lse.contiguous()


_LIB.impl("rows_attend_with_lse", rows_attend_with_lse_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("offgraph_kv::rows_attend_with_lse")
def _rows_attend_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):  # noqa: ANN202
    b, h, r, _ = q.shape
    return (q.new_empty((b, h, r, v.shape[-1]), dtype=torch.float32),
            q.new_empty((b, h, r), dtype=torch.float32))


def shim_options() -> Dict[str, object]:
    """AOTInductor options that make the generated code call our kernels by name."""
    return {"aot_inductor.custom_ops_to_c_shims": {torch.ops.offgraph_kv.rows_attend_with_lse.default: [C_SHIM]}}


def _compile_flags() -> List[str]:
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    include = os.path.join(os.path.dirname(torch.__file__), "include")
    # The ISA of inductor's kernels, no more: the manifest's target names it, and the
    # runtime checks the loading machine against that (aoti_compile.target_of).
    isa = pick_vec_isa().build_arch_flags().split()
    return ["-O3", "-fPIC", "-std=c++17", "-fopenmp", "-fno-gnu-unique", "-DNDEBUG", *isa, "-I", include]


def build_object(cache_dir: str, compiler: str = "g++") -> str:
    """The kernels' object file, compiled once per source, flags and compiler."""
    flags = _compile_flags()
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + "\0".join([compiler, *flags]).encode()).hexdigest()[:24]
    directory = os.path.join(cache_dir, "offgraph_kv_native")
    os.makedirs(directory, exist_ok=True)
    obj = os.path.join(directory, f"decode_attention_{key}.o")
    if os.path.exists(obj):
        return obj
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".o")
    os.close(fd)
    done = subprocess.run([compiler, "-c", str(SOURCE), "-o", tmp, *flags], capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"compiling {SOURCE.name} failed:\n{done.stderr[-4000:]}")
    os.replace(tmp, obj)  # a concurrent build never links a half-written object
    return obj
