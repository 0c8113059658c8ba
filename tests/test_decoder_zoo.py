"""Decoders users actually write (tests/zoo.py), exported and generated through the
real ExecuTorch runtime against the oracle, and bad steps rejected with the cache
unchanged.

Each zoo entry either matches the oracle's greedy tokens (and logits) over a
prefill and several decode steps, or fails at export with an error saying what
to change. Every program is compiled once per session.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List, Tuple

import pytest
import torch
from executorch.exir import to_edge_transform_and_lower
from executorch.extension.llm.cache.reference_cache import LayerPolicy
from executorch.extension.llm.cache.update_and_attend import REGISTRY

import offgraph_kv.runtime
from offgraph_kv.backend.cache_ops import LoweringError
from offgraph_kv.partitioner import OffGraphKVPartitioner
from zoo import (CosSinInputs, Entry, ExtraInputs, FlatPositions, LayerShape, PerLayerReference, PosFirst,
                 RopeBeforeEmbedding, RowPositions, RowPositionsToOp, ZooConfig, outputs)

MAX_WRITE = 8
FLAT, RING = LayerPolicy.flat(), LayerPolicy.ring(5)
MIXED = ZooConfig(layers=(LayerShape(4, 2, 12), LayerShape(6, 3, 8), LayerShape(2, 1, 16)), layer_id_stride=2)

ZOO: List[Entry] = [
    Entry("pos_first", PosFirst, ZooConfig(), ("pos", "tokens"),
          what="forward(pos, tokens): the delegate's input order is not the model's"),
    Entry("rope_before_embedding_last_logits", RopeBeforeEmbedding, ZooConfig(), ("tokens", "pos"),
          storage=torch.bfloat16,
          what="RoPE tables from positions before the embedding (positions used first); last-position logits only; bf16 KV"),
    Entry("cos_sin_inputs_logits_and_hidden", CosSinInputs, ZooConfig(), ("tokens", "cos", "sin", "pos"),
          layers=(FLAT, RING, FLAT),
          what="precomputed cos/sin as inputs; full logits plus the final hidden state; flat and ring layers"),
    Entry("extra_inputs_used_and_unused", ExtraInputs, ZooConfig(), ("flag", "tokens", "pos", "scale"),
          extras={"scale": 0.5},
          what="a scale input the partition uses and a flag it does not"),
    Entry("tied_fused_qkv_flat_positions", FlatPositions, ZooConfig(fused_qkv=True, tied=True), ("tokens", "pos"),
          positions="flat", layers=(RING,), storage=torch.bfloat16,
          what="tied embeddings, one fused QKV linear (with bias) split in three, 1-D positions [T]; ring layers, bf16 KV"),
    Entry("heterogeneous_layers_row_positions", RowPositions, MIXED, ("tokens", "pos"), positions="row",
          layers=(FLAT, RING, FLAT),
          what="layers with different query/KV heads and head dims; HF-style [1, T] position ids; "
               "layer ids 0, 2, 4 (not dense), one policy per cache layer in id order"),
    Entry("value_head_dim_of_its_own_fused_qkv", PosFirst,
          ZooConfig(layers=(LayerShape(4, 2, 12, v_head_dim=8),) * 2, fused_qkv=True), ("pos", "tokens"),
          what="values with their own head dim (8, keys 12, as MLA-style attention has) out of a fused QKV"),
    Entry("decode_only_static_width", PosFirst, ZooConfig(), ("pos", "tokens"), static_width=True,
          layers=(RING,), storage=torch.bfloat16,
          what="exported for one-token steps only (no dynamic dim); prefill token by token; ring layers, bf16 KV"),
    Entry("neox_rope_by_cat_gqa_and_mqa", RowPositions,
          ZooConfig(layers=(LayerShape(4, 1, 12, rotary_dim=12), LayerShape(4, 2, 12, rotary_dim=6),
                            LayerShape(6, 2, 8, rotary_dim=8))),
          ("tokens", "pos"), positions="row", layers=(FLAT, RING, FLAT),
          what="GPT-NeoX / Phi RoPE: rotated dims and the pass-through tail joined by torch.cat "
               "(an empty tail on full rotary, which leaves the query head-strided); MQA and GQA; flat and ring"),
    Entry("interleaved_rope_prescaled_query_bf16", RowPositions,
          ZooConfig(layers=(LayerShape(4, 2, 12), LayerShape(4, 1, 12), LayerShape(4, 4, 12)), interleaved_rope=True),
          ("tokens", "pos"), positions="row", layers=(FLAT, RING, FLAT), storage=torch.bfloat16,
          what="GPT-J / Meta RoPE on adjacent pairs by unbind / stack / flatten, the query scaled before the op "
               "(scale 1.0); GQA, MQA and MHA layers; flat and ring; bf16 storage"),
    Entry("row_positions_passed_to_the_op", RowPositionsToOp, ZooConfig(), ("tokens", "pos"), positions="row",
          export_error="position must be [T, n_dims]",
          what="[1, T] positions handed to the op, whose contract is [T, n_dims]"),
]
BY_NAME = {e.name: e for e in ZOO}


def lower_entry(entry: Entry) -> bytes:
    model = entry.model()
    ep = torch.export.export(model, entry.example(), dynamic_shapes=entry.dynamic_shapes(MAX_WRITE))
    # A small initial capacity so that generation grows flat storage twice.
    part = OffGraphKVPartitioner(storage_dtype=entry.storage, layers=entry.layers,
                                 max_write=1 if entry.static_width else MAX_WRITE, initial_capacity=6)
    return to_edge_transform_and_lower(ep, partitioner=[part]).to_executorch().buffer


@pytest.fixture(scope="session")
def zoo_pte(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("zoo")
    built: Dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            path = root / f"{name}.pte"
            path.write_bytes(lower_entry(BY_NAME[name]))
            built[name] = path
        return built[name]

    return get


def last_logits(out: List[torch.Tensor]) -> torch.Tensor:
    logits = out[0]
    return logits[0, -1] if logits.dim() == 3 else logits[0]


class ZooSession:
    """A loaded zoo program stepped the way its model takes inputs."""

    def __init__(self, entry: Entry, pte: Path) -> None:
        self.entry = entry
        self.method = offgraph_kv.runtime.load_method(pte)
        self.store = offgraph_kv.runtime.stores()[-1]
        self.length = 0

    def step(self, tokens: torch.Tensor) -> List[torch.Tensor]:
        out = outputs(self.method.execute(list(self.entry.inputs(tokens, self.length))))
        self.length += tokens.shape[1]
        return out


class ZooOracle:
    """The same eager model over ExecuTorch's reference cache (one per layer)."""

    def __init__(self, entry: Entry, key: str) -> None:
        self.entry, self.key = entry, key
        self.model = entry.model()
        REGISTRY.install(key, PerLayerReference(entry.cfg, entry.layers, entry.storage))
        self.length = 0

    def step(self, tokens: torch.Tensor) -> List[torch.Tensor]:
        with REGISTRY.active(self.key), torch.no_grad():
            out = outputs(self.model(*self.entry.inputs(tokens, self.length)))
        self.length += tokens.shape[1]
        return out


def generate(step: Callable[[torch.Tensor], List[torch.Tensor]], prompt: torch.Tensor,
             n: int, chunk: int = MAX_WRITE) -> Tuple[List[int], List[List[torch.Tensor]]]:
    """Prefill in chunks of at most ``chunk`` tokens, then n greedy decode steps."""
    outs = [step(prompt[:, i:i + chunk]) for i in range(0, prompt.shape[1], chunk)]
    ids = []
    for _ in range(n):
        ids.append(int(last_logits(outs[-1]).argmax()))
        outs.append(step(torch.tensor([[ids[-1]]])))
    return ids, outs


def prompt_for(entry: Entry, n: int = 11, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, entry.cfg.vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", [e.name for e in ZOO if not e.export_error])
def test_zoo_decoder_generates_the_oracle_tokens(name: str, zoo_pte: Callable[[str], Path]) -> None:
    entry = BY_NAME[name]
    session = ZooSession(entry, zoo_pte(name))
    oracle = ZooOracle(entry, f"zoo-{name}")
    # 11 prompt tokens (chunks of 8 + 3) then 12 decode steps: the ring (window 5,
    # 12 slots) wraps, and flat storage grows past its initial capacity when asked.
    chunk = 1 if entry.static_width else MAX_WRITE
    got, got_outs = generate(session.step, prompt_for(entry), 12, chunk)
    want, want_outs = generate(oracle.step, prompt_for(entry), 12, chunk)
    assert got == want, f"{name}: greedy tokens differ from the oracle's"
    tol = 1e-4 if entry.storage == torch.float32 else 2e-2
    for i, (g, w) in enumerate(zip(got_outs, want_outs)):
        assert len(g) == len(w), f"{name}: {len(g)} outputs, the model returns {len(w)}"
        for j, (a, b) in enumerate(zip(g, w)):
            assert a.shape == b.shape and a.dtype == b.dtype, f"{name} step {i} output {j}: {a.shape} vs {b.shape}"
            torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=f"{name} step {i} output {j}")
    assert session.store.metrics()["length"] == session.length


@pytest.mark.parametrize("name", [e.name for e in ZOO if e.export_error])
def test_zoo_decoder_outside_the_op_contract_fails_at_export_naming_the_fix(name: str) -> None:
    entry = BY_NAME[name]
    with pytest.raises(LoweringError, match=entry.export_error.replace("[", r"\[").replace("]", r"\]")):
        lower_entry(entry)


def test_delegate_inputs_are_listed_in_the_order_step_width_indexes() -> None:
    entry = BY_NAME["rope_before_embedding_last_logits"]
    ep = torch.export.export(entry.model(), entry.example(), dynamic_shapes=entry.dynamic_shapes(MAX_WRITE))
    names = [n for n, _ in OffGraphKVPartitioner().delegate_inputs(ep)]
    # The model takes (tokens, pos) but uses pos first: the delegate takes (pos, tokens).
    assert names == ["pos", "tokens"]


def test_a_step_width_naming_a_dim_that_is_not_the_width_is_refused_at_export_listing_the_inputs() -> None:
    entry = BY_NAME["pos_first"]
    ep = torch.export.export(entry.model(), entry.example(), dynamic_shapes=entry.dynamic_shapes(MAX_WRITE))
    with pytest.raises(LoweringError, match=r"step_width '1:0'.*0: pos \[s\d+, 1\], 1: tokens \[1, s\d+\]"):
        to_edge_transform_and_lower(ep, partitioner=[OffGraphKVPartitioner(step_width="1:0")])


# --------------------------------------------------------------------------- #
# Bad steps: rejected, named, and the cache exactly as before
# --------------------------------------------------------------------------- #


def _bad_steps(entry: Entry, length: int) -> Dict[str, Tuple[torch.Tensor, ...]]:
    """Inputs in the model's order (pos, tokens) for steps the runtime must reject."""
    def pos(n: int, start: int = length) -> torch.Tensor:
        return torch.arange(start, start + n, dtype=torch.long).unsqueeze(-1)

    ok = torch.tensor([[1, 2]])
    return {
        "width 0": (pos(0), torch.zeros(1, 0, dtype=torch.long)),
        "width above max_write": (pos(MAX_WRITE + 1), torch.ones(1, MAX_WRITE + 1, dtype=torch.long)),
        "token and position widths disagree": (pos(3), ok),
        "wrong rank": (pos(2), ok.reshape(2)),
        "int32 tokens": (pos(2), ok.to(torch.int32)),
        "float positions": (pos(2).float(), ok),
        "token id above the vocabulary": (pos(2), torch.tensor([[1, entry.cfg.vocab + 7]])),
        "negative token id": (pos(2), torch.tensor([[-3, 1]])),
    }


def test_bad_steps_are_rejected_and_leave_the_cache_as_it_was(zoo_pte: Callable[[str], Path]) -> None:
    entry = BY_NAME["pos_first"]  # the delegate's order is the model's here; the width rides on input 1
    pte = zoo_pte("pos_first")
    prompt = prompt_for(entry, 6)
    follow = torch.tensor([[5, 9, 4]])

    clean = ZooSession(entry, pte)
    clean.step(prompt)
    want = clean.step(follow)[0]

    abused = ZooSession(entry, pte)
    abused.step(prompt)
    # What the exception says, where the delegate (not ExecuTorch's own input checks) rejects the step.
    named = {"width 0": "step width 0 (input 0 dim 0) outside [1, max_write=8]",
             "token and position widths disagree": "input 1 [1, 2] dim 1: extent 2 carries the step width, but the step width is 3",
             "token id above the vocabulary": "index out of bounds"}
    for what, args in _bad_steps(entry, abused.length).items():
        with pytest.raises(RuntimeError) as err:
            abused.method.execute(list(args))
        assert abused.store.metrics()["length"] == abused.length, f"{what}: the rejected step changed the length"
        if what in named:
            assert named[what] in str(err.value), f"{what}: {err.value}"
    torch.testing.assert_close(abused.step(follow)[0], want, atol=0, rtol=0)
