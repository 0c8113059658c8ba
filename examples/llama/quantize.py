"""Weight-only quantization of the example model through torchao, before export.

Both schemes keep activations in the model's dtype and quantize every
``nn.Linear`` weight (the token embedding stays as it is); AOTInductor compiles
the dequantize-and-multiply, and the quantized weights are what the .pte
carries outside the code (int8 bytes plus scales):

- ``int8``: one scale per output row (torchao ``Int8WeightOnlyConfig``); in a
  bf16 model each quantized linear is then run by ATen's int8 GEMM
  (``Int8RowLinear``): one thread, SmolLM2's 576 x 1536 projection, 0.025 ms
  against bf16's 0.062 ms for one token, but 3x bf16's time for 64 (and with
  fp32 activations that kernel is scalar, 12x slower than fp32's matmul, so
  fp32 models keep torchao's dequantize-and-multiply);
- ``int4``: values in [-8, 7] with one scale per ``group_size`` inputs
  (torchao ``IntxWeightOnlyConfig(weight_dtype=torch.int4, PerGroup)``, the
  layout torchao exports for CPU). Each value is stored in a byte, so int4
  saves no memory over int8 yet; it trades accuracy for the same footprint
  until a packed CPU kernel exists in AOTInductor's reach.

A GGUF's own quantized blocks are dequantized first and then requantized here
(the GGUF importer dequantizes every tensor type); the checkpoint's quantization
is not carried over.
"""

from __future__ import annotations

import importlib.metadata
from typing import Dict, Optional

import torch

SCHEMES = ("int8", "int4")
# ATen ops outside the core opset that quantized models call (the exporter
# admits them: ``EdgeCompileConfig(_core_aten_ops_exception_list=...)``).
EXTRA_ATEN_OPS = (torch.ops.aten._weight_int8pack_mm.default,)
DEFAULT_GROUP_SIZE = 32


def quantize_model(model: torch.nn.Module, scheme: Optional[str], group_size: int = DEFAULT_GROUP_SIZE) -> \
        Optional[Dict[str, object]]:
    """Quantize ``model``'s linear weights in place; returns what the sidecar records (None: no scheme)."""
    if scheme is None:
        return None
    if scheme not in SCHEMES:
        raise ValueError(f"quantize: unknown scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if not linears:
        raise ValueError("quantize: the model has no nn.Linear to quantize")
    if scheme == "int4":
        if group_size < 1:
            raise ValueError(f"quantize: group size must be >= 1, got {group_size}")
        bad = [f"{name} ({m.in_features} inputs)" for name, m in linears.items() if m.in_features % group_size]
        if bad:
            raise ValueError(f"quantize int4: group size {group_size} does not divide the inputs of "
                             f"{', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}")
        config = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))
    else:
        config = Int8WeightOnlyConfig()
    quantize_(model, config)
    if scheme == "int8":
        _use_int8_gemm(model)
    return {"scheme": scheme, "group_size": group_size if scheme == "int4" else None,
            "linears": len(linears), "torchao": importlib.metadata.version("torchao")}


class Int8RowLinear(torch.nn.Module):
    """A torchao int8 weight-only linear run by ATen's int8 GEMM
    (``aten._weight_int8pack_mm``: int8 weights read as stored, one scale per
    output row applied to the dot products), which AOTInductor calls through
    its C shim. The generic lowering of torchao's tensor dequantized every
    weight to floats on every step: SmolLM2 decoded at half fp32's speed."""

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.out_features, self.in_features = qdata.shape
        self.register_buffer("qdata", qdata.contiguous())
        self.register_buffer("scale", scale.reshape(-1).contiguous())  # the activations' dtype, as the kernel needs
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.qdata, self.scale)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def _use_int8_gemm(model: torch.nn.Module) -> None:
    """Swap every linear torchao quantized to int8 for an ``Int8RowLinear`` of the same values."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            w = getattr(child, "weight", None) if isinstance(child, torch.nn.Linear) else None
            if w is None or not hasattr(w, "qdata"):
                continue
            zero = getattr(w, "zero_point", None)
            if zero is not None and bool(zero.any()):
                raise ValueError(f"quantize int8: {name} has nonzero zero points; the int8 GEMM is symmetric")
            act = getattr(w, "dtype", torch.float32)  # the dtype the linear computes in
            if act != torch.bfloat16:
                continue  # ATen's int8 GEMM is vectorised for bf16 activations only (fp32: 12x slower than fp32)
            setattr(parent, name, Int8RowLinear(w.qdata, w.scale.to(act), child.bias))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights and buffers as stored (a quantized weight: its integer data plus scales)."""
    def nbytes(t: torch.Tensor) -> int:
        names, _ = t.__tensor_flatten__() if hasattr(t, "__tensor_flatten__") else ([], None)
        if names:  # a torchao tensor subclass: the plain tensors it is made of
            return sum(nbytes(getattr(t, n)) for n in names)
        return t.numel() * t.element_size()

    seen = {id(t): t for t in [*model.parameters(), *model.buffers()]}  # int8 GEMM weights are buffers
    return sum(nbytes(t.data if isinstance(t, torch.nn.Parameter) else t) for t in seen.values())
