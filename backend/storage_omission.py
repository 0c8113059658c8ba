"""Proof that the lowered output holds zero bytes of KV storage."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from offgraph_kv.schemas.manifest import Manifest


@dataclass(frozen=True)
class OmissionReport:
    weight_bytes: int  # constants baked into the compiled code
    kv_bytes_in_output: int  # always 0 once proven
    kv_bytes_per_token: int  # what the runtime will allocate per token instead


def _constant_bytes(ep: ExportedProgram) -> int:
    seen = set()
    total = 0
    for t in list(ep.state_dict.values()) + list(ep.constants.values()):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def prove_storage_omission(
    compiled: ExportedProgram, source: ExportedProgram, manifest: Manifest
) -> OmissionReport:
    """Check that every private tensor is a run-time input and no constant is KV.

    The compiled program's constants must be exactly the source program's
    weights: anything more would be storage that lowering baked in.
    """
    num_user_inputs = sum(s.kind.name == "USER_INPUT" for s in compiled.graph_signature.input_specs)
    for t in manifest.tensors:
        if t.compiled_input >= num_user_inputs:
            raise AssertionError(
                f"layer {t.layer} {t.role}: compiled input {t.compiled_input} is not a run-time input of the compiled program"
            )
    compiled_bytes = _constant_bytes(compiled)
    source_bytes = _constant_bytes(source)
    if compiled_bytes > source_bytes:
        raise AssertionError(
            f"the compiled program holds {compiled_bytes} bytes of constants but the model has only "
            f"{source_bytes} bytes of weights: storage was baked in"
        )
    return OmissionReport(
        weight_bytes=compiled_bytes,
        kv_bytes_in_output=0,
        kv_bytes_per_token=manifest.kv_bytes_per_token(),
    )
