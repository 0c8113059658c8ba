"""The lowered program holds zero bytes of KV: capacity is a run-time choice, not file size."""

from __future__ import annotations

import re

import torch
from conftest import TOY

from offgraph_kv.schemas import Manifest


def _longest_zero_run(data: bytes) -> int:
    return max((len(m.group(0)) for m in re.finditer(rb"\x00{256,}", data)), default=0)


def test_pte_size_does_not_depend_on_max_capacity(pte_factory):
    small = pte_factory(storage_dtype=torch.bfloat16, max_capacity=1024).read_bytes()
    large = pte_factory(storage_dtype=torch.bfloat16, max_capacity=1 << 20).read_bytes()
    m_small = Manifest.from_bytes(small[small.index(b"OGKV") - 4:])
    m_large = Manifest.from_bytes(large[large.index(b"OGKV") - 4:])
    assert (m_small.max_capacity, m_large.max_capacity) == (1024, 1 << 20)
    # Only the manifest's integers differ: equal sizes (both fit the same field width).
    assert len(small) == len(large)
    kv_at_max = (1 << 20) * m_large.kv_bytes_per_token()
    assert kv_at_max > 10 * len(large), "the test model must make a baked-in cache impossible to miss"


def test_pte_holds_no_kv_sized_zero_block(pte_factory):
    data = pte_factory(storage_dtype=torch.bfloat16, max_capacity=65536).read_bytes()
    manifest = Manifest.from_bytes(data[data.index(b"OGKV") - 4:])
    one_layer_at_initial = manifest.initial_capacity * manifest.tensors[0].bytes_per_row()
    assert _longest_zero_run(data) < one_layer_at_initial
    # Weights are all the payload there is: code + fp32 weights, nothing per token.
    weights = sum(p.numel() * 4 for p in __import__("conftest").toy_model().parameters())
    assert len(data) < weights + 4 * 1024 * 1024


def test_manifest_accounts_for_kv_bytes_per_token():
    m_bytes = TOY.n_layers * 2 * TOY.n_kv_heads * TOY.head_dim * 2
    from offgraph_kv.schemas import PrivateTensor

    tensors = [PrivateTensor(layer=i // 2, role=("key", "value")[i % 2], kind="flat", window=0,
                             num_heads=TOY.n_kv_heads, head_dim=TOY.head_dim, storage_dtype=torch.bfloat16,
                             compiled_input=2 + i) for i in range(2 * TOY.n_layers)]
    m = Manifest(device="cpu", target="cpu:x", num_user_inputs=2, num_outputs=1, max_write=4, capacity_bound=1 << 20,
                 initial_capacity=8, max_capacity=64, growth_factor=2.0, compiled_code_key="k", tensors=tensors)
    assert m.kv_bytes_per_token() == m_bytes
    assert Manifest.from_bytes(m.to_bytes()) == m
