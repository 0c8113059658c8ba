"""Weight-only quantization of the example model through torchao, before export.

Both schemes keep activations in the model's dtype and quantize every
``nn.Linear`` weight (the token embedding stays as it is); AOTInductor compiles
the dequantize-and-multiply, and the quantized weights are what the .pte
carries outside the code (int8 bytes plus scales):

- ``int8``: one scale per output row (torchao ``Int8WeightOnlyConfig``);
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
    return {"scheme": scheme, "group_size": group_size if scheme == "int4" else None,
            "linears": len(linears), "torchao": importlib.metadata.version("torchao")}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights as stored (a quantized weight: its integer data plus scales)."""
    def nbytes(t: torch.Tensor) -> int:
        names, _ = t.__tensor_flatten__() if hasattr(t, "__tensor_flatten__") else ([], None)
        if names:  # a torchao tensor subclass: the plain tensors it is made of
            return sum(nbytes(getattr(t, n)) for n in names)
        return t.numel() * t.element_size()

    seen = {id(p): p for p in model.parameters()}
    return sum(nbytes(p.data if isinstance(p, torch.nn.Parameter) else p) for p in seen.values())
