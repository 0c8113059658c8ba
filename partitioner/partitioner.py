"""``OffGraphKVPartitioner``: claims the decoder around ``update_and_attend``."""

from __future__ import annotations

from typing import Callable, List, Mapping, Optional, Sequence, Tuple

import torch
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from executorch.exir.backend.utils import get_non_lowered_nodes, tag_constant_data
from executorch.extension.llm.cache.reference_cache import LayerPolicy
from torch.export.exported_program import ExportedProgram
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from offgraph_kv.backend import OffGraphKVBackend
from offgraph_kv.backend.cache_ops import LoweringError, find_sites, is_cache_op
from offgraph_kv.backend.compile_specs import BackendSpecs, StepWidth
from offgraph_kv.backend.step_width import delegate_input_nodes, locate, shape_of, step_width_bound
from offgraph_kv.schemas.manifest import check_growth_policy, dtype_from_name

# The compiled code's bound on readable rows. It is fixed rather than taken from
# max_capacity so that exports differing only in max_capacity compile to the same
# code: capacity is a run-time policy, not a property of the program.
DEFAULT_CAPACITY_BOUND = 1 << 20
SUPPORTED_DEVICES = ("cpu", "cuda")


class OffGraphKVPartitioner(Partitioner):
    """Delegates the subgraph that holds every ``kvcache::update_and_attend``.

    Args:
        device: "cpu" or "cuda": where the compiled code and the KV storage live.
        storage_dtype: KV storage dtype (bf16 default; fp16, fp32).
        max_capacity: export-time default of the largest readable length (None:
            the compiled bound).
        initial_capacity: rows allocated at load.
        growth_factor: flat storage grows by this factor (clamped at max_capacity).
        step_width: "input_index:dim" of the delegate input that carries the
            step's token count; derived from the signature when None.
        layers: LayerPolicy per layer (one for all, or one per layer).
        max_write: the widest step a ring must absorb (default: the export bound).
        rewind_budget: extra ring slots, so a ring layer can be rewound up to
            max_write + rewind_budget positions after any step (export default of a
            load-time option; flat layers rewind without limit).
    """

    def __init__(
        self,
        device: str = "cpu",
        storage_dtype: "torch.dtype | str" = torch.bfloat16,
        max_capacity: Optional[int] = None,
        initial_capacity: int = 256,
        growth_factor: float = 2.0,
        step_width: "str | Tuple[int, int] | None" = None,
        layers: Sequence[LayerPolicy] = (LayerPolicy.flat(),),
        max_write: Optional[int] = None,
        capacity_bound: Optional[int] = None,
        rewind_budget: int = 0,
    ) -> None:
        if device not in SUPPORTED_DEVICES:
            raise ValueError(f"device {device!r} is not supported; expected one of {SUPPORTED_DEVICES}")
        self.device = device
        self.storage_dtype = dtype_from_name(storage_dtype)
        self.capacity_bound = int(capacity_bound or max(DEFAULT_CAPACITY_BOUND, max_capacity or 0))
        self.max_capacity = int(max_capacity or self.capacity_bound)
        self.initial_capacity = int(initial_capacity)
        self.growth_factor = float(growth_factor)
        if self.max_capacity > self.capacity_bound:
            raise ValueError(f"max_capacity {self.max_capacity} exceeds capacity_bound {self.capacity_bound}")
        check_growth_policy(self.initial_capacity, self.max_capacity, self.growth_factor, rewind_budget,
                            capacity_limit=self.capacity_bound + 1)
        self.step_width = None if step_width is None else StepWidth.parse(step_width)
        self.layers = tuple(layers)
        if not self.layers:
            raise ValueError("layers needs at least one LayerPolicy")
        self.max_write = max_write
        self.rewind_budget = int(rewind_budget)
        self.delegation_spec: Optional[DelegationSpec] = None

    def _policies(self, n_layers: int) -> Tuple[LayerPolicy, ...]:
        if len(self.layers) == 1:
            return self.layers * n_layers
        if len(self.layers) != n_layers:
            raise LoweringError(
                f"layers has {len(self.layers)} policies but the model has {n_layers} cache layers; give one, or one per layer"
            )
        return self.layers

    def _claim(self, exported_program: ExportedProgram) -> Tuple[list, "set[torch.fx.Node]"]:
        """The cache sites and the one partition that holds them (nothing tagged yet)."""
        graph = exported_program.graph
        sites = find_sites(graph)
        if not sites:
            raise LoweringError(
                "the program has no kvcache::update_and_attend call; OffGraphKVPartitioner has nothing to own"
            )
        candidates = set(get_non_lowered_nodes(graph))
        for s in sites:
            if s.node not in candidates:
                raise LoweringError(f"{s.node.name}: already claimed by another partitioner")

        class _Claim(OperatorSupportBase):
            def is_node_supported(self, submodules: Mapping[str, torch.nn.Module], node: torch.fx.Node) -> bool:
                return node.op == "call_function" and node in candidates

        proposed = CapabilityBasedPartitioner(
            exported_program.graph_module, _Claim(), allows_single_node_partition=True
        ).propose_partitions()
        with_cache = [p for p in proposed if any(is_cache_op(n) for n in p.nodes)]
        if len(with_cache) != 1:
            names = [[n.name for n in p.nodes if is_cache_op(n)] for p in with_cache]
            raise LoweringError(
                f"the cache ops fall into {len(with_cache)} separate partitions {names}; "
                "one store serves one partition, so they must form one connected subgraph"
            )
        return sites, set(with_cache[0].nodes)

    def delegate_inputs(self, exported_program: ExportedProgram) -> List[Tuple[str, Optional[torch.Size]]]:
        """The delegate's inputs as the runtime passes them (name, shape), in the order
        ``step_width`` indexes: the order of first use inside the partition, which
        is not the model's argument order in general."""
        _, nodes = self._claim(exported_program)
        return [(n.name, shape_of(n)) for n in delegate_input_nodes(exported_program, nodes)]

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        sites, nodes = self._claim(exported_program)
        spec = self._specs_for(exported_program, nodes, sites)
        tag = "offgraph_kv_0"
        for node in nodes:
            node.meta["delegation_tag"] = tag
        tag_constant_data(exported_program)
        self.delegation_spec = DelegationSpec(OffGraphKVBackend.__name__, spec.to_compile_specs())
        return PartitionResult(tagged_exported_program=exported_program, partition_tags={tag: self.delegation_spec})

    def _specs_for(self, ep: ExportedProgram, nodes: "set[torch.fx.Node]", sites: list) -> BackendSpecs:
        inputs = delegate_input_nodes(ep, nodes)
        loc = locate(sites, [n.name for n in inputs], [shape_of(n) for n in inputs], self.step_width)
        compiled_max_write = step_width_bound(ep, sites[0].width)
        max_write = compiled_max_write if self.max_write is None else int(self.max_write)
        if not 1 <= max_write <= compiled_max_write:
            raise LoweringError(
                f"max_write {self.max_write} must be in [1, {compiled_max_write}] (the export bound of the step width)"
            )
        policies = self._policies(len(sites))
        return BackendSpecs(
            step_width=loc,
            device=self.device,
            storage_dtype=self.storage_dtype,
            initial_capacity=self.initial_capacity,
            rewind_budget=self.rewind_budget,
            max_capacity=self.max_capacity,
            capacity_bound=self.capacity_bound,
            growth_factor=self.growth_factor,
            max_write=max_write,
            layers=policies,
        )

    def ops_to_not_decompose(
        self, ep: ExportedProgram
    ) -> Tuple[List[torch._ops.OpOverload], Optional[Callable[[torch.fx.Node], bool]]]:
        # AOTInductor decomposes for its target itself; keeping ops whole (SDPA
        # above all) lets it pick fused kernels.
        keep = {n.target for n in ep.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)}
        return list(keep), None
