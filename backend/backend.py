"""``OffGraphKVBackend.preprocess``: private tensors, AOTInductor code, manifest."""

from __future__ import annotations

import hashlib
import logging
from typing import Dict, List, Sequence, Tuple

import torch
from executorch.exir._serialize._named_data_store import NamedDataStore
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.extension.llm.cache.reference_cache import LayerKind
from torch.export import Dim, ExportedProgram

from offgraph_kv.backend import decode_gemv, quantized_linear, triton_attention
from offgraph_kv.backend.aoti_compile import compile_shared_object, target_of
from offgraph_kv.backend.cache_ops import CacheOpSite, LoweringError, find_sites
from offgraph_kv.backend.compile_specs import BackendSpecs, StepWidth
from offgraph_kv.backend.edge_to_aten import edge_to_aten
from offgraph_kv.backend.private_tensors import (
    PrivateTensorProgram,
    bind_private_tensors,
    compiled_input_index,
    length_input_index,
    private_tensor_examples,
)
from offgraph_kv.backend.step_width import export_upper_bound, locate, step_width_bound
from offgraph_kv.backend.storage_omission import prove_storage_omission
from offgraph_kv.backend.weights import add_weights_to_store, check_weights_are_read_only, weights_in_code_requested
from offgraph_kv.schemas.manifest import (
    SCALAR_TYPES,
    CompiledInterface,
    InputDim,
    Manifest,
    PrivateTensor,
    UserInput,
)

log = logging.getLogger(__name__)

# Sizes used for tracing. Both above 1 so export does not specialise them.
_EXAMPLE_WIDTH = 3
_EXAMPLE_ROWS = 7


def _user_inputs(ep: ExportedProgram) -> List[torch.fx.Node]:
    names = set(ep.graph_signature.user_inputs)
    return [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in names]


def _examples_and_dims(
    ep: ExportedProgram, inputs: List[torch.fx.Node], width: "int | torch.SymInt"
) -> Tuple[List[torch.Tensor], List[Dict[int, Dim]]]:
    """Concrete example inputs and their dynamic dims, from the program's symbols."""
    dims: Dict[object, Dim] = {}
    examples, shapes = [], []
    for node in inputs:
        val = node.meta["val"]
        if not isinstance(val, torch.Tensor):
            raise LoweringError(f"input {node.name}: only tensor inputs are supported, got {type(val).__name__}")
        sizes, spec = [], {}
        for d, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt):
                expr = size.node.expr
                if expr not in dims:
                    # Automatic dims: SDPA's meta functions emit stride guards (e.g.
                    # T*min(32, 128*T) == 32*T) that hold for every size but that
                    # export cannot prove over a named range. Bounds stay enforced:
                    # ExecuTorch checks each input against its export bound, and the
                    # runtime checks widths and capacity itself.
                    dims[expr] = Dim.DYNAMIC
                spec[d] = dims[expr]
                hint = _EXAMPLE_WIDTH if isinstance(width, torch.SymInt) and expr == width.node.expr else None
                sizes.append(hint or max(int(ep.range_constraints[expr].lower), 2))
            else:
                sizes.append(int(size))
        examples.append(torch.zeros(sizes, dtype=val.dtype))
        shapes.append(spec)
    return examples, shapes


def describe_inputs(ep: ExportedProgram, inputs: List[torch.fx.Node], width: "int | torch.SymInt",
                    locator: StepWidth) -> List[UserInput]:
    """What the runtime checks of every delegate input before a step: dtype, rank,
    static extents, which dims carry the step width, bounds of other dynamic dims.
    A static width is carried by the locator's dim alone (every dim is checked)."""
    out = []
    for i, node in enumerate(inputs):
        val = node.meta["val"]
        if val.dtype not in SCALAR_TYPES:
            raise LoweringError(f"input {node.name}: dtype {val.dtype} is not supported as a delegate input")
        dims = []
        for d, size in enumerate(val.shape):
            if not isinstance(size, torch.SymInt):
                located = (i, d) == (locator.input_index, locator.dim)
                dims.append(InputDim("width", 0) if located else InputDim("static", int(size)))
            elif isinstance(width, torch.SymInt) and size.node.expr == width.node.expr:
                dims.append(InputDim("width", 0))
            else:
                upper = export_upper_bound(ep, size)
                dims.append(InputDim("dynamic", upper if upper is not None and upper < 2**62 else 0))
        out.append(UserInput(val.dtype, dims))
    return out


def build_manifest(
    sites: Sequence[CacheOpSite], specs: BackendSpecs, num_user_inputs: int, num_outputs: int, code_key: str,
    target: str, has_length_input: bool, inputs: Sequence[UserInput] = (), width_bound: int = 0,
) -> Manifest:
    tensors = []
    for s in sites:
        policy = specs.layers[s.layer_id]
        kind = "ring" if policy.kind is LayerKind.RING else "flat"
        for j, (role, hd) in enumerate((("key", s.head_dim), ("value", s.v_head_dim))):
            tensors.append(
                PrivateTensor(
                    layer=s.layer_id,
                    role=role,
                    kind=kind,
                    window=policy.window,
                    num_heads=s.num_kv_heads,
                    head_dim=hd,
                    storage_dtype=specs.storage_dtype,
                    compiled_input=compiled_input_index(num_user_inputs, s.layer_id, j),
                )
            )
    return Manifest(
        device=specs.device,
        target=target,
        num_user_inputs=num_user_inputs,
        num_outputs=num_outputs,
        max_write=specs.max_write,
        capacity_bound=specs.capacity_bound,
        initial_capacity=specs.initial_capacity,
        rewind_budget=specs.rewind_budget,
        max_capacity=specs.max_capacity,
        growth_factor=specs.growth_factor,
        compiled_code_key=code_key,
        tensors=tensors,
        # The committed length follows the K/V tensors among the compiled inputs.
        length_input=length_input_index(num_user_inputs, len(sites)) if has_length_input else None,
        inputs=list(inputs),
        width_bound=width_bound or specs.max_write,
    )


def validate_manifest(manifest: Manifest, compiled: ExportedProgram) -> None:
    """The manifest must agree with the compiled program's inputs, one by one."""
    user = [n for n in compiled.graph.nodes if n.op == "placeholder"
            and n.name in set(compiled.graph_signature.user_inputs)]
    expected = manifest.num_user_inputs + len(manifest.tensors) + (manifest.length_input is not None)
    if len(user) != expected:
        raise LoweringError(f"manifest describes {expected} compiled inputs, the compiled program takes {len(user)}")
    # The runtime refuses a manifest that disagrees with the compiled interface
    # (runtime/src/code_interface.cpp); say so here, at export, instead.
    interface = manifest.interface()
    for i, (u, (_, sizes)) in enumerate(zip(manifest.inputs, interface.inputs)):
        for d, (dim, compiled) in enumerate(zip(u.dims, sizes)):
            ok = {"static": compiled == dim.extent, "width": compiled in (-1, manifest.max_write),
                  "dynamic": compiled == -1}[dim.kind]
            if not ok:
                raise LoweringError(
                    f"delegate input {i} dim {d} is {dim.kind} in the exported program, but the compiled program "
                    f"takes {list(sizes)} (-1: dynamic): export it with a static extent, or keep it dynamic"
                )
    for t in manifest.tensors:
        val = user[t.compiled_input].meta["val"]
        if val.dtype != t.storage_dtype or val.dim() != 4 or tuple(val.shape[2:]) != (t.num_heads, t.head_dim):
            raise LoweringError(
                f"manifest layer {t.layer} {t.role}: [1, S, {t.num_heads}, {t.head_dim}] {t.storage_dtype} "
                f"does not match compiled input {t.compiled_input} {list(val.shape)} {val.dtype}"
            )


def compiled_interface(compiled: ExportedProgram, width_bound: int, weights_in_code: bool,
                       lengths_from_device: bool = False, ring_windows: Sequence[int] = ()) -> CompiledInterface:
    """What the compiled code takes, read from the program AOTInductor compiled:
    the runtime checks the manifest against this, so it must not come from the
    manifest. ``lengths_from_device``: every layer attends through our kernels,
    which read the length from device memory (``triton_attention.py``).
    ``ring_windows``: each layer's window as the code was compiled with it."""
    names = set(compiled.graph_signature.user_inputs)
    inputs = []
    for node in compiled.graph.nodes:
        if node.op != "placeholder" or node.name not in names:
            continue
        val = node.meta["val"]
        sizes = tuple(-1 if isinstance(n, torch.SymInt) else int(n) for n in val.shape)
        inputs.append((SCALAR_TYPES[val.dtype], sizes))
    return CompiledInterface(tuple(inputs), len(compiled.graph_signature.user_outputs), width_bound, weights_in_code,
                             lengths_from_device, tuple(int(w) for w in ring_windows))


class OffGraphKVBackend(BackendDetails):
    @staticmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: List[CompileSpec]) -> PreprocessResult:
        specs = BackendSpecs.from_compile_specs(compile_specs)
        sites = find_sites(edge_program.graph)
        if not sites:
            raise LoweringError("OffGraphKVBackend: the partition holds no kvcache::update_and_attend")
        if len(specs.layers) != len(sites):
            raise LoweringError(f"compile specs give {len(specs.layers)} layer policies for {len(sites)} cache layers")
        inputs = _user_inputs(edge_program)
        # The partitioner predicted the delegate's input order; these are the
        # inputs as lowered, in the order the runtime passes them. A locator
        # that does not name a step-width dim here is an error, never a run.
        locator = locate(sites, [n.name for n in inputs], [n.meta["val"].shape for n in inputs], specs.step_width)
        width = sites[0].width
        width_bound = step_width_bound(edge_program, width)
        if not 1 <= specs.max_write <= width_bound:
            raise LoweringError(f"max_write {specs.max_write} must be in [1, {width_bound}] (the export bound of the step width)")
        described = describe_inputs(edge_program, inputs, width, locator)

        device = specs.device
        if device == "cuda":
            if not torch.cuda.is_available():
                raise LoweringError("device='cuda' needs a CUDA device at export: AOTInductor compiles for the GPU it sees")
            from torch.export.passes import move_to_device_pass

            # Weights and constants go to the device; the trace then happens there.
            edge_program = move_to_device_pass(edge_program, "cuda")
            inputs = _user_inputs(edge_program)
        examples, dyn = _examples_and_dims(edge_program, inputs, sites[0].width)
        examples = [e.to(device) for e in examples]
        program = edge_to_aten(edge_program.module())
        reduce = device == "cpu" and decode_gemv.reduction_applies()
        # Quantized-linear ops never reach AOTInductor as calls (it would need them registered at run time).
        quantized_linear.lower_quantized_linears(program, reduce=reduce, cpu=device == "cpu")
        if reduce:
            decode_gemv.use_reductions_for_one_row(program)
        bind_private_tensors(program)
        windows = [p.window if p.kind is LayerKind.RING else 0 for p in specs.layers]
        kernels = triton_attention.kernels_apply(device, specs.storage_dtype)
        wrapper = PrivateTensorProgram(program, len(inputs), windows, kernels=kernels)
        # Automatic too, for the same reason (on CUDA: min(16*S, 32*S) == 16*S);
        # the runtime keeps readable rows within max_capacity <= capacity_bound.
        rows = Dim.DYNAMIC
        private = private_tensor_examples(sites, _EXAMPLE_ROWS, specs.storage_dtype, device, windows, specs.max_write,
                                          specs.rewind_budget, has_length_input=wrapper.has_length_input)
        # Flat storage binds a prefix of any length; rings are bound whole, with
        # as many slots as the load-time rewind budget adds (the code reads it).
        dyn = dyn + [{1: rows} for _ in range(2 * len(sites))]
        if wrapper.has_length_input:
            dyn.append(None)
        with torch.no_grad():
            compiled_ep = torch.export.export(wrapper, tuple(examples + private), dynamic_shapes={"args": tuple(dyn)}, strict=False)
        num_outputs = len(compiled_ep.graph_signature.user_outputs)
        weights_in_code = weights_in_code_requested()
        if not weights_in_code:
            check_weights_are_read_only(compiled_ep)
        code = compile_shared_object(compiled_ep, examples + private, device, weights_in_code=weights_in_code)
        so_bytes = code.so_bytes
        interface = compiled_interface(compiled_ep, width_bound, weights_in_code, lengths_from_device=kernels,
                                       ring_windows=windows).to_bytes()
        # One digest over the code and what it takes: the load verifies both.
        code_key = "offgraph_kv_" + hashlib.sha256(so_bytes + interface).hexdigest()[:32] + "_so"

        manifest = build_manifest(sites, specs, len(inputs), num_outputs, code_key, target_of(device),
                                  wrapper.has_length_input, described, width_bound)
        manifest.compiled_interface = interface
        # Weights outside the code (weights.py): listed in the manifest, bytes as named data.
        manifest.weights = [w.spec for w in code.weights]
        validate_manifest(manifest, compiled_ep)
        report = prove_storage_omission(compiled_ep, edge_program, manifest)
        store = NamedDataStore()
        store.add_named_data(code_key, so_bytes, 16, None)
        outside = add_weights_to_store(code.weights, store)
        log.info("offgraph-kv: %d weight bytes (%d as named data outside the %d-byte code), %d KV bytes/token left "
                 "to the runtime", report.weight_bytes, outside, len(so_bytes), report.kv_bytes_per_token)
        return PreprocessResult(
            processed_bytes=manifest.to_bytes(),
            debug_handle_map={},
            data_store_output=store.get_named_data_store_output(),
        )
