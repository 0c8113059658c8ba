"""Malformed programs and lowering errors get an error that names the problem."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import TOY, Session, lower, prompt, toy_model

from offgraph_kv.backend.cache_ops import LoweringError
from offgraph_kv.partitioner import OffGraphKVPartitioner
from offgraph_kv.schemas import Manifest


def _manifest_span(data: bytes) -> "tuple[int, Manifest, bytes]":
    at = data.index(b"OGKV") - 4  # root offset, then the file identifier
    manifest = Manifest.from_bytes(data[at:])
    encoded = manifest.to_bytes()
    assert data[at:at + len(encoded)] == encoded, "manifest not found verbatim in the .pte"
    return at, manifest, encoded


def _patched(src: Path, dst: Path, at: int, new: bytes) -> Path:
    data = bytearray(src.read_bytes())
    data[at:at + len(new)] = new
    dst.write_bytes(bytes(data))
    return dst


def _load_error(path: Path, capfd: pytest.CaptureFixture) -> str:
    capfd.readouterr()
    with pytest.raises(RuntimeError):
        Session(path)
    return capfd.readouterr().err


def test_the_pte_carries_a_readable_payload_free_manifest(pte_factory):
    data = pte_factory(storage_dtype=torch.bfloat16, initial_capacity=8).read_bytes()
    _, m, encoded = _manifest_span(data)
    # Payload-free: fixed fields, plus per weight its name, key and geometry (no bytes).
    assert len(encoded) < 1024 + 256 * len(m.weights)
    assert m.num_user_inputs == 2 and len(m.tensors) == 2 * TOY.n_layers
    assert [(t.layer, t.role, t.compiled_input) for t in m.tensors[:2]] == [(0, "key", 2), (0, "value", 3)]
    assert {t.storage_dtype for t in m.tensors} == {torch.bfloat16}
    assert m.target.startswith("cpu:")


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda m: replace(m, version=7), "version 7 is not supported"),
        (lambda m: replace(m, num_outputs=2), "num_outputs is 2, the code returns 1"),
        (lambda m: replace(m, tensors=[replace(t, storage_dtype=torch.float16) if i == 3 else t
                                       for i, t in enumerate(m.tensors)]), "mixed storage dtypes"),
    ],
    ids=["future-version", "output-count", "mixed-dtype"],
)
def test_manifest_disagreeing_with_the_program_is_rejected_at_load(pte_factory, tmp_path, capfd, edit, expected):
    src = pte_factory(storage_dtype=torch.bfloat16, initial_capacity=8)
    at, m, encoded = _manifest_span(src.read_bytes())
    new = edit(m).to_bytes()
    assert len(new) == len(encoded)
    path = _patched(src, tmp_path / "edited.pte", at, new)
    assert expected in _load_error(path, capfd)


def test_unsupported_storage_dtype_in_manifest_is_rejected(pte_factory, tmp_path, capfd):
    import flatbuffers

    from offgraph_kv.schemas import manifest_generated as fb

    src = pte_factory(storage_dtype=torch.bfloat16, initial_capacity=8)
    data = src.read_bytes()
    at, _, encoded = _manifest_span(data)
    # Re-encode through the generated object API: dtype 9 is a value no build knows.
    m = fb.ManifestT.InitFromPackedBuf(bytearray(encoded), 0)
    m.tensors[0].storageDtype = 9
    builder = flatbuffers.Builder(256)
    builder.Finish(m.Pack(builder), file_identifier=b"OGKV")
    new = bytes(builder.Output())
    assert len(new) == len(encoded)
    path = _patched(src, tmp_path / "dtype.pte", at, new)
    assert "storage dtype 9 is not supported by this build" in _load_error(path, capfd)


def test_corrupt_or_foreign_manifest_is_rejected(pte_factory, tmp_path, capfd):
    src = pte_factory(storage_dtype=torch.bfloat16, initial_capacity=8)
    at, _, _ = _manifest_span(src.read_bytes())
    foreign = _patched(src, tmp_path / "foreign.pte", at + 4, b"XXXX")
    assert "missing the 'OGKV' file identifier" in _load_error(foreign, capfd)
    corrupt = _patched(src, tmp_path / "corrupt.pte", at, b"\xff\xff\x00\x00")
    assert "corrupt or truncated FlatBuffer" in _load_error(corrupt, capfd)


def _step_width_value_offset(data: bytes) -> int:
    key = data.index(b"step_width")
    # The spec's value is a short byte vector near its key.
    for delta in range(-96, 96):
        if data[key + delta:key + delta + 3] == b"0:1":
            return key + delta
    raise AssertionError("step_width value not found")


def test_step_width_naming_a_missing_input_fails_at_load(pte_factory, tmp_path, capfd):
    src = pte_factory(storage_dtype=torch.bfloat16, initial_capacity=8)
    path = _patched(src, tmp_path / "input.pte", _step_width_value_offset(src.read_bytes()), b"7:1")
    assert "step_width names input 7, but the delegate has 2 inputs" in _load_error(path, capfd)


def test_step_width_naming_a_dim_that_does_not_carry_the_width_fails_at_load(pte_factory, tmp_path, capfd):
    src = pte_factory(storage_dtype=torch.bfloat16, initial_capacity=8)
    path = _patched(src, tmp_path / "dim.pte", _step_width_value_offset(src.read_bytes()), b"0:5")
    assert "names input 0 dim 5, which the manifest does not record as carrying the step width" in _load_error(path, capfd)
    path = _patched(src, tmp_path / "dim0.pte", _step_width_value_offset(src.read_bytes()), b"0:0")
    assert "names input 0 dim 0, which the manifest does not record" in _load_error(path, capfd)


def test_given_step_width_is_checked_against_the_signature():
    model = toy_model()
    with pytest.raises(LoweringError, match=r"input 0 dim 0 has extent 1, but the cache op's step width is"):
        lower(model, step_width="0:0", storage_dtype=torch.float32)
    with pytest.raises(LoweringError, match=r"input 5 is not a tensor input"):
        lower(model, step_width="5:0", storage_dtype=torch.float32)
    with pytest.raises(LoweringError, match=r"input 1 has only 2 dims"):
        lower(model, step_width="1:3", storage_dtype=torch.float32)


def test_model_without_cache_op_and_bad_policies_are_named():
    class NoCache(torch.nn.Module):
        def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
            return tokens.float() * 2

    with pytest.raises(LoweringError, match="no kvcache::update_and_attend"):
        lower(NoCache())
    from executorch.extension.llm.cache.reference_cache import LayerPolicy

    with pytest.raises(LoweringError, match="layers has 2 policies but the model has 3 cache layers"):
        lower(toy_model(), layers=[LayerPolicy.flat(), LayerPolicy.flat()])
    with pytest.raises(ValueError, match="storage_dtype 'int8' is not supported"):
        OffGraphKVPartitioner(storage_dtype="int8")
    with pytest.raises(ValueError, match="initial_capacity 100"):
        OffGraphKVPartitioner(initial_capacity=100, max_capacity=50)


def test_cache_op_with_wrong_head_layout_is_named():
    class BadHeads(torch.nn.Module):
        def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
            t = tokens.shape[1]
            q = torch.zeros(1, 3, t, 8)
            k = torch.zeros(1, 2, t, 8)
            return torch.ops.kvcache.update_and_attend(q, k, k, input_pos, 0, 1.0, torch.float32)

    with pytest.raises(LoweringError, match=r"update_and_attend.*3 query heads is not a multiple of 2 KV heads"):
        lower(BadHeads())
