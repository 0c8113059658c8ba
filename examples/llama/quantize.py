"""Quantization of the example model's linears through torchao, before export.

Every scheme quantizes every ``nn.Linear`` weight (the token embedding stays
as it is) with torchao, then
hand each quantized linear to the backend's quantized-linear ops
(``offgraph_kv/backend/quantized_linear.py``), whose integers are what the .pte
carries outside the code:

- ``int8``: one scale per output row (torchao ``Int8WeightOnlyConfig``), run
  as ``offgraph_kv::int8_linear`` (``Int8RowLinear``): on CPU a one-row step is
  the backend's kernel over the int8 bytes; wider steps of a bf16 model are
  the same kernels' GEMM on the AVX-512 bf16 dot product where the CPU has it,
  otherwise torchao's dequantize-and-multiply (a block of weight rows at a
  time);
- ``int4``: values in [-8, 7] with one scale (and zero point, if torchao made
  one) per ``group_size`` inputs (torchao ``IntxWeightOnlyConfig(weight_dtype=
  torch.int4, PerGroup)``), stored two per byte and run as
  ``offgraph_kv::int4_linear`` (``Int4GroupLinear``): a one-row step unpacks
  and dequantizes inside one kernel; wider steps as int8's;
- ``8da4w``: int8 dynamic activations, quantized per token, with symmetric
  int4 weights in groups (torchao ``Int8DynamicActivationIntxWeightConfig(
  weight_dtype=torch.int4, PerGroup)``, ExecuTorch's usual scheme for LLMs on
  CPU), run as ``offgraph_kv::int4_da8_linear`` (``DynamicLinear``): on CPU
  every step width is one integer-dot kernel over the weights in tiles, as
  llama.cpp's Q4_0 dots its int8-quantized activations;
- ``8da8w``: the same activations with int8 weights, one scale per output row
  (``Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8,
  PerAxis(0))``), run as ``offgraph_kv::int8_da8_linear``
  (``DynamicLinear``), llama.cpp's Q8_0 x Q8_0 in kind.

``int8`` and ``int4`` keep the activations in the model's dtype (weight-only);
``8da4w`` / ``8da8w`` change the arithmetic (activations rounded to 8 bits per
token), which is what buys their speed on CPU.

``quantize_model(..., torchao_only=True)`` stops after torchao: the eager
reference the compiled program is checked against (``run.py --check``).

A GGUF's own quantized blocks are dequantized first and then requantized here
(the GGUF importer dequantizes every tensor type); the checkpoint's quantization
is not carried over.
"""

from __future__ import annotations

import importlib.metadata
from typing import Dict, Optional

import torch

from offgraph_kv.backend.quantized_linear import (  # also registers the offgraph_kv:: ops
    pack_int4, pack_int4_tiles, pack_int8_tiles)

SCHEMES = ("int8", "int4", "8da4w", "8da8w")
GROUPED = ("int4", "8da4w")  # the schemes with a group size
DEFAULT_GROUP_SIZE = 32


def quantize_model(model: torch.nn.Module, scheme: Optional[str], group_size: int = DEFAULT_GROUP_SIZE,
                   torchao_only: bool = False) -> Optional[Dict[str, object]]:
    """Quantize ``model``'s linear weights in place; returns what the sidecar records (None: no scheme).
    ``torchao_only``: leave torchao's tensors (the reference) instead of the backend's ops."""
    if scheme is None:
        return None
    if scheme not in SCHEMES:
        raise ValueError(f"quantize: unknown scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    from torchao.quantization import (Int8DynamicActivationIntxWeightConfig, Int8WeightOnlyConfig,
                                      IntxWeightOnlyConfig, quantize_)
    from torchao.quantization.granularity import PerAxis, PerGroup

    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if not linears:
        raise ValueError("quantize: the model has no nn.Linear to quantize")
    if scheme in GROUPED:
        step = 8 if scheme == "8da4w" else 2  # the kernel's tile of 8 inputs; two values a byte
        if group_size < step or group_size % step:
            raise ValueError(f"quantize {scheme}: group size must be a multiple of {step}, got {group_size}")
        bad = [f"{name} ({m.in_features} inputs)" for name, m in linears.items() if m.in_features % group_size]
        if bad:
            raise ValueError(f"quantize {scheme}: group size {group_size} does not divide the inputs of "
                             f"{', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}")
        if scheme == "int4":
            config = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))
        else:
            config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                           weight_granularity=PerGroup(group_size))
    elif scheme == "8da8w":
        bad = [f"{name} ({m.in_features} inputs)" for name, m in linears.items() if m.in_features % 4]
        if bad:
            raise ValueError(f"quantize 8da8w: the kernel takes inputs in multiples of 4, not those of "
                             f"{', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}")
        config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))
    else:
        config = Int8WeightOnlyConfig()
    quantize_(model, config)
    if not torchao_only:
        _use_backend_ops(model, scheme, group_size)
    return {"scheme": scheme, "group_size": group_size if scheme in GROUPED else None,
            "linears": len(linears), "torchao": importlib.metadata.version("torchao")}


class _BackendLinear(torch.nn.Module):
    """A quantized linear computed by one of the backend's ops (``_product``), plus the float bias if any."""

    def __init__(self, qdata: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.out_features, self.in_features = qdata.shape
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x)
        return y if self.bias is None else y + self.bias


class Int8RowLinear(_BackendLinear):
    """A torchao int8 weight-only linear as ``offgraph_kv::int8_linear``: int8
    weights read as stored, one scale per output row applied to the dot
    products. The generic lowering of torchao's tensor dequantized every weight
    to floats on every step: SmolLM2 decoded at half fp32's speed."""

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__(qdata, bias)
        self.register_buffer("qdata", qdata.contiguous())
        self.register_buffer("scale", scale.reshape(-1).contiguous())  # the activations' dtype, as ATen's GEMM needs

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.offgraph_kv.int8_linear(x, self.qdata, self.scale)


class Int4GroupLinear(_BackendLinear):
    """A torchao int4 group-wise linear as ``offgraph_kv::int4_linear``: the
    same values packed two per byte (``pack_int4``), a scale (and a zero point
    when torchao made a nonzero one) per group."""

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], group_size: int,
                 bias: Optional[torch.Tensor]) -> None:
        super().__init__(qdata, bias)
        self.group_size = group_size
        self.register_buffer("packed", pack_int4(qdata, group_size))
        self.register_buffer("scale", scale.reshape(self.out_features, -1).contiguous())
        self.register_buffer("zero", None if zero is None else zero.reshape(self.out_features, -1).contiguous())

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.offgraph_kv.int4_linear(x, self.packed, self.scale, self.zero)


class DynamicLinear(_BackendLinear):
    """A torchao 8da4w / 8da8w linear as ``offgraph_kv::int4_da8_linear`` / ``int8_da8_linear``: the
    integer values in the kernel's tiles (``pack_int4_tiles`` / ``pack_int8_tiles``), their scales beside
    them, and each output row's sum (the activations' zero point meets it once per row, not once per
    weight). ``group_size``: int4 groups; None: int8 with a scale a row."""

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, group_size: Optional[int],
                 bias: Optional[torch.Tensor]) -> None:
        super().__init__(qdata, bias)
        self.four_bit = group_size is not None
        if group_size is not None:
            packed, tiled_scale, sums = pack_int4_tiles(qdata, scale.reshape(self.out_features, -1), group_size)
        else:
            packed, tiled_scale, sums = pack_int8_tiles(qdata, scale)
        self.register_buffer("packed", packed)
        self.register_buffer("scale", tiled_scale)
        self.register_buffer("sums", sums)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.offgraph_kv
        op = ops.int4_da8_linear if self.four_bit else ops.int8_da8_linear
        return op(x, self.packed, self.scale, self.sums)


def _use_backend_ops(model: torch.nn.Module, scheme: str, group_size: int) -> None:
    """Swap every linear torchao quantized for the backend op's module of the same values."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            w = getattr(child, "weight", None) if isinstance(child, torch.nn.Linear) else None
            if w is None or not hasattr(w, "qdata"):
                continue
            zero = getattr(w, "zero_point", None)
            nonzero = zero is not None and bool(zero.any())
            act = getattr(w, "dtype", torch.float32)  # the dtype the linear computes in
            if scheme in ("int8", "8da8w"):
                if nonzero:
                    raise ValueError(f"quantize {scheme}: {name} has nonzero zero points; the kernels are symmetric")
                if scheme == "int8":
                    setattr(parent, name, Int8RowLinear(w.qdata, w.scale.to(act), child.bias))
                else:
                    setattr(parent, name, DynamicLinear(w.qdata, w.scale.to(act), None, child.bias))
            else:
                if tuple(w.block_size) != (1, group_size):
                    raise ValueError(f"quantize {scheme}: {name} has blocks {tuple(w.block_size)}, "
                                     f"not (1, {group_size})")
                if scheme == "int4":
                    setattr(parent, name, Int4GroupLinear(w.qdata, w.scale.to(act), zero if nonzero else None,
                                                          group_size, child.bias))
                elif nonzero:
                    raise ValueError(f"quantize 8da4w: {name} has nonzero zero points; the kernel's weights are "
                                     "symmetric")
                else:
                    setattr(parent, name, DynamicLinear(w.qdata, w.scale.to(act), group_size, child.bias))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights and buffers as stored (a quantized weight: its integer data plus scales)."""
    def nbytes(t: torch.Tensor) -> int:
        names, _ = t.__tensor_flatten__() if hasattr(t, "__tensor_flatten__") else ([], None)
        if names:  # a torchao tensor subclass: the plain tensors it is made of
            return sum(nbytes(getattr(t, n)) for n in names)
        return t.numel() * t.element_size()

    seen = {id(t): t for t in [*model.parameters(), *model.buffers()]}  # int8 GEMM weights are buffers
    return sum(nbytes(t.data if isinstance(t, torch.nn.Parameter) else t) for t in seen.values())
