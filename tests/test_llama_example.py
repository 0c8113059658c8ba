"""The Llama example: checkpoint loaders, tokenizers, export.py and run.py end to end.

One .pte is exported per session (AOTInductor compiles take ~20 s here); every
test that needs the compiled path shares it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest
import torch

os.environ.setdefault("AOTI_RUNTIME_CHECK_INPUTS", "1")

LLAMA_DIR = Path(__file__).resolve().parents[1] / "examples" / "llama"
if str(LLAMA_DIR) not in sys.path:
    sys.path.insert(0, str(LLAMA_DIR))

import checkpoint  # noqa: E402
import export  # noqa: E402
import run  # noqa: E402
import tokenizer  # noqa: E402
from model import ModelArgs, Transformer, init_deterministic, positions  # noqa: E402

from executorch.extension.llm.cache.reference_cache import CacheConfig, ContiguousReferenceCache  # noqa: E402
from executorch.extension.llm.cache.update_and_attend import REGISTRY  # noqa: E402

_keys = itertools.count()


@contextlib.contextmanager
def reference_cache(args: ModelArgs, capacity: int = 256, dtype: torch.dtype = torch.float32) -> Iterator[None]:
    """A fresh ExecuTorch reference cache, active for the ``with`` body."""
    key = f"test-llama-example-{next(_keys)}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        REGISTRY.install(key, ContiguousReferenceCache(CacheConfig(
            n_layers=args.n_layers, n_kv_heads=args.n_kv_heads, head_dim=args.head_dim,
            capacity=capacity, dtype=dtype, layers=args.layer_policies())))
    try:
        with REGISTRY.active(key), torch.no_grad():
            yield
    finally:
        REGISTRY.uninstall(key)


def eager_steps(model: Transformer, tokens: torch.Tensor, widths: List[int]) -> torch.Tensor:
    """Logits for ``tokens`` [1, T] fed in steps of ``widths``, on a fresh reference cache."""
    outs, pos = [], 0
    with reference_cache(model.args):
        for w in widths:
            outs.append(model(tokens[:, pos:pos + w], positions(pos, w)))
            pos += w
    return torch.cat(outs, dim=1)


def tiny_args(**overrides: object) -> ModelArgs:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300)
    base.update(overrides)
    return ModelArgs(**base)


# --------------------------------------------------------------------------- #
# Hugging Face format
# --------------------------------------------------------------------------- #


# Small shapes every transformers model below shares.
_HF_SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300)
_QWEN2_SLIDING = dict(tie_word_embeddings=True, rope_theta=1e6, use_sliding_window=True, sliding_window=4,
                      max_window_layers=1, max_position_embeddings=256)
# Qwen3 as Qwen2 is, with heads wider than hidden_size / heads (as Qwen3's 128 are) and linear RoPE
# scaling, so one small model covers both new features.
_QWEN3_SLIDING = dict(_QWEN2_SLIDING, head_dim=24,
                      rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6})


# The config class of a family whose name is not <family>Config (Gemma 3's text-only model).
_HF_CONFIG_CLASSES = {"Gemma3": "Gemma3TextConfig"}


def _saved_transformers_model(path: Path, family: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                              max_shard_size: str = "1GB", **config: object):  # noqa: ANN201
    """A transformers ``<family>ForCausalLM`` of _HF_SMALL shapes plus ``config``, saved to ``path``."""
    transformers = pytest.importorskip("transformers")
    cfg = getattr(transformers, _HF_CONFIG_CLASSES.get(family, f"{family}Config"))(**{**_HF_SMALL, **config})
    torch.manual_seed(seed)
    hf = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        # Default init leaves norms at 1 and small weights; perturb everything so
        # a swapped or mis-permuted tensor cannot hide.
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf = hf.to(dtype)
    hf.save_pretrained(path, max_shard_size=max_shard_size)
    return hf


def _edit_config(directory: Path, update: Optional[Dict[str, object]] = None, drop: Tuple[str, ...] = ()) -> dict:
    """Rewrite ``directory``'s config.json without the ``drop`` keys and with ``update``; the config as it was."""
    path = directory / "config.json"
    saved = json.loads(path.read_text())
    edited = {k: v for k, v in saved.items() if k not in drop}
    path.write_text(json.dumps({**edited, **(update or {})}))
    return saved


def _eager_steps_give_transformers_logits(hf: "torch.nn.Module", loaded: "checkpoint.LoadedCheckpoint", seed: int,
                                          widths: List[int]) -> torch.Tensor:
    """Random tokens (``seed``) stepped through ``loaded``'s model in steps of ``widths`` give transformers'
    logits over them, computed at once; the tokens."""
    tokens = torch.randint(0, 300, (1, sum(widths)), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = hf(tokens, use_cache=False).logits
    torch.testing.assert_close(eager_steps(loaded.model, tokens, widths), expected, atol=2e-5, rtol=1e-4)
    return tokens


def _save_transformers_llama(path: Path, tie: bool, shard: bool, dtype: torch.dtype = torch.float32):  # noqa: ANN202
    return _saved_transformers_model(
        path, "Llama", dtype=dtype, max_shard_size="100KB" if shard else "1GB",
        intermediate_size=160, rms_norm_eps=1e-5, tie_word_embeddings=tie, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})


@pytest.mark.parametrize("tie,shard", [(False, True), (True, False)], ids=["untied-sharded", "tied-single-file"])
def test_hf_checkpoint_from_transformers_gives_transformers_logits(tmp_path: Path, tie: bool, shard: bool) -> None:
    hf = _save_transformers_llama(tmp_path, tie=tie, shard=shard)
    assert (tmp_path / "model.safetensors.index.json").is_file() == shard
    loaded = checkpoint.load_hf(tmp_path)
    assert loaded.args.tie_embeddings == tie
    assert loaded.args.rope_scaling["rope_type"] == "llama3"
    assert loaded.dtype == torch.float32

    tokens = torch.randint(0, 300, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens, use_cache=False).logits
    # One prefill step, and the same tokens as a prefill plus decode steps.
    for widths in ([11], [6, 1, 1, 3]):
        got = eager_steps(loaded.model, tokens, widths)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_hf_checkpoint_keeps_its_dtype_unless_cast(tmp_path: Path) -> None:
    _save_transformers_llama(tmp_path, tie=False, shard=False, dtype=torch.bfloat16)
    assert checkpoint.load_hf(tmp_path).dtype == torch.bfloat16
    assert {p.dtype for p in checkpoint.load_hf(tmp_path).model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in checkpoint.load_hf(tmp_path, dtype="fp32").model.parameters()} == {torch.float32}


# --------------------------------------------------------------------------- #
# Meta format
# --------------------------------------------------------------------------- #

META_PARAMS = {
    "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 300, "multiple_of": 32,
    "ffn_dim_multiplier": 1.3, "norm_eps": 1e-5, "rope_theta": 500000.0, "use_scaled_rope": True,
}


def _meta_reference_model() -> Transformer:
    return init_deterministic(Transformer(checkpoint.meta_args(META_PARAMS)), seed=3).eval()


def _write_meta(directory: Path, state: Dict[str, torch.Tensor], params: Dict[str, object]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(state, directory / "consolidated.00.pth")
    (directory / "params.json").write_text(json.dumps(params))
    return directory / "consolidated.00.pth"


def test_meta_checkpoint_gives_the_logits_of_the_model_it_was_written_from(tmp_path: Path) -> None:
    reference = _meta_reference_model()
    state = checkpoint.to_meta_state_dict(reference)
    state["rope.freqs"] = torch.zeros(8)  # Llama 2 checkpoints carry this derived table
    path = _write_meta(tmp_path, state, META_PARAMS)
    loaded = checkpoint.load_meta(path)  # params.json found next to the checkpoint
    assert loaded.args.rope_scaling["factor"] == 8.0

    tokens = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    expected = eager_steps(reference, tokens, [9])
    torch.testing.assert_close(eager_steps(loaded.model, tokens, [9]), expected, atol=0, rtol=0)
    torch.testing.assert_close(eager_steps(loaded.model, tokens, [4, 1, 4]), expected, atol=1e-5, rtol=1e-5)


def test_meta_model_parallel_shards_are_concatenated(tmp_path: Path) -> None:
    reference = _meta_reference_model()
    full = checkpoint.to_meta_state_dict(reference)
    shards: List[Dict[str, torch.Tensor]] = [{}, {}]
    for name, t in full.items():
        dim = checkpoint._meta_shard_dim(name)
        parts = [t, t] if dim is None else list(t.chunk(2, dim=dim))
        for shard, part in zip(shards, parts):
            shard[name] = part.clone()
    for i, shard in enumerate(shards):
        torch.save(shard, tmp_path / f"consolidated.{i:02d}.pth")
    (tmp_path / "params.json").write_text(json.dumps(META_PARAMS))
    loaded = checkpoint.load_meta(tmp_path)
    for name, t in reference.state_dict().items():
        torch.testing.assert_close(loaded.model.state_dict()[name], t, atol=0, rtol=0)


def _meta_interleaved_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Meta's apply_rotary_emb: pairs (2i, 2i+1) rotated as complex numbers. x: [T, H, D]."""
    freqs = torch.polar(torch.ones(len(pos), len(inv_freq)), pos.float()[:, None] * inv_freq[None, :])
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs[:, None, :]).flatten(-2)


def test_meta_permutation_matches_interleaved_rope_attention_scores() -> None:
    # Independent of the loader's own inverse: the q.k scores Meta's interleaved
    # rotation gives on the raw weights must equal model.py's half-split
    # rotation on the permuted weights.
    args = checkpoint.meta_args(META_PARAMS)
    g = torch.Generator().manual_seed(5)
    wq = torch.randn(args.n_heads * args.head_dim, args.dim, generator=g)
    wk = torch.randn(args.n_kv_heads * args.head_dim, args.dim, generator=g)
    x = torch.randn(7, args.dim, generator=g)
    pos = torch.arange(3, 10)
    inv_freq = Transformer(args).inv_freq
    q_meta = _meta_interleaved_rope((x @ wq.T).view(7, args.n_heads, -1), pos, inv_freq)
    k_meta = _meta_interleaved_rope((x @ wk.T).view(7, args.n_kv_heads, -1), pos, inv_freq)

    from model import _rotate

    angles = pos[:, None].float() * inv_freq
    cos, sin = angles.cos(), angles.sin()
    q = (x @ checkpoint.permute_interleaved_to_half(wq, args.n_heads).T).view(7, args.n_heads, -1).transpose(0, 1)
    k = (x @ checkpoint.permute_interleaved_to_half(wk, args.n_kv_heads).T).view(7, args.n_kv_heads, -1).transpose(0, 1)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    group = args.n_heads // args.n_kv_heads
    scores = q @ k.repeat_interleave(group, dim=0).transpose(-1, -2)
    scores_meta = q_meta.transpose(0, 1) @ k_meta.transpose(0, 1).repeat_interleave(group, dim=0).transpose(-1, -2)
    torch.testing.assert_close(scores, scores_meta, atol=1e-3, rtol=1e-4)


# --------------------------------------------------------------------------- #
# Errors name what is wrong
# --------------------------------------------------------------------------- #


def _write_hf(directory: Path, args: ModelArgs, mutate=None, config_update=None) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    state = checkpoint.to_hf_state_dict(init_deterministic(Transformer(args)))
    if mutate:
        mutate(state)
    config = checkpoint.hf_config(args)
    config.update(config_update or {})
    (directory / "config.json").write_text(json.dumps(config))
    save_file(state, str(directory / "model.safetensors"))
    return directory


def test_hf_round_trip_through_our_writer_is_exact(tmp_path: Path) -> None:
    args = tiny_args(hidden_dim=96)
    loaded = checkpoint.load_hf(_write_hf(tmp_path, args))
    for name, t in init_deterministic(Transformer(args)).state_dict().items():
        torch.testing.assert_close(loaded.model.state_dict()[name], t, atol=0, rtol=0)


def test_hf_missing_tensor_is_named(tmp_path: Path) -> None:
    d = _write_hf(tmp_path, tiny_args(), mutate=lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        checkpoint.load_hf(d)


def test_hf_wrong_shape_is_named(tmp_path: Path) -> None:
    def shrink(s: Dict[str, torch.Tensor]) -> None:
        s["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    d = _write_hf(tmp_path, tiny_args(), mutate=shrink)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight'.*shape \(16, 64\).*\(32, 64\)"):
        checkpoint.load_hf(d)


def test_hf_unused_tensor_is_named(tmp_path: Path) -> None:
    def extra(s: Dict[str, torch.Tensor]) -> None:
        s["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)

    d = _write_hf(tmp_path, tiny_args(), mutate=extra)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_norm\.weight'.*not used"):
        checkpoint.load_hf(d)


def test_hf_unknown_architecture_is_named(tmp_path: Path) -> None:
    d = _write_hf(tmp_path, tiny_args(), config_update={"architectures": ["Gemma3ForConditionalGeneration"]})
    with pytest.raises(ValueError, match="unsupported architecture 'Gemma3ForConditionalGeneration'"):
        checkpoint.load_hf(d)



def test_hf_explicit_head_dim_and_pytorch_bin_weights_load_like_transformers(tmp_path: Path) -> None:
    """An explicit head_dim other than hidden_size / heads (as Llama-3.1-Minitron-4B-Width has), from
    pytorch_model.bin instead of safetensors: the logits are transformers' own."""
    hf = _saved_transformers_model(tmp_path, "Llama", head_dim=24)
    from safetensors.torch import load_file

    torch.save(load_file(str(tmp_path / "model.safetensors")), tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").unlink()
    loaded = checkpoint.load_hf(tmp_path)
    assert loaded.args.head_dim == 24
    _eager_steps_give_transformers_logits(hf, loaded, 2, [5, 1, 3])


def test_hf_mistral_sliding_window_loads_as_ring_layers_with_transformers_logits(tmp_path: Path) -> None:
    """Mistral's sliding window (a query at p sees keys p - window < k <= p) is a ring on every layer."""
    hf = _saved_transformers_model(tmp_path, "Mistral", sliding_window=4, max_position_embeddings=256)
    loaded = checkpoint.load_hf(tmp_path)
    assert loaded.args.layer_policies()[0].window == 4
    # Windows passed inside the prefill and across decode steps.
    _eager_steps_give_transformers_logits(hf, loaded, 3, [6, 1, 1, 2, 1, 1, 1])


def test_hf_qwen2_with_qkv_biases_and_sliding_layers_gives_transformers_logits(tmp_path: Path) -> None:
    """Qwen2: q/k/v biases, tied embeddings, a sliding window from layer max_window_layers on."""
    hf = _saved_transformers_model(tmp_path, "Qwen2", **_QWEN2_SLIDING)
    loaded = checkpoint.load_hf(tmp_path)
    assert loaded.args.qkv_bias and not loaded.args.out_bias and loaded.args.tie_embeddings
    assert [p.window for p in loaded.args.layer_policies()] == [0, 4]
    _eager_steps_give_transformers_logits(hf, loaded, 4, [5, 1, 1, 3, 1, 1])
    # Our writer's config reads back as the same model shape.
    again = checkpoint.load_hf(_write_hf(tmp_path / "ours", loaded.args)).args
    assert (again.qkv_bias, again.out_bias, again.tie_embeddings, again.layer_policies()) == \
        (True, False, True, loaded.args.layer_policies())


# Phi-3 (fused q/k/v and gate/up projections) with its sliding window on every layer, GQA.
_PHI3_SLIDING = dict(sliding_window=5, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def test_hf_phi3_fused_projections_give_transformers_logits(tmp_path: Path) -> None:
    """Phi-3 stores q/k/v as one projection and gate/up as another: split along the rows, they give
    transformers' logits, its sliding window a ring on every layer."""
    hf = _saved_transformers_model(tmp_path, "Phi3", **_PHI3_SLIDING)
    loaded = checkpoint.load_hf(tmp_path)
    assert [p.window for p in loaded.args.layer_policies()] == [5, 5]
    _eager_steps_give_transformers_logits(hf, loaded, 7, [6, 1, 1, 2, 1, 1, 1])


# The Gemma family on _HF_SMALL shapes: heads narrower than hidden_size / heads, a softmax scale that is
# not 1/sqrt(head_dim), sliding layers in transformers' default patterns, a final logit cap, and (Gemma 3)
# a RoPE base per layer kind with linear scaling on the full layers only.
_GEMMA_FAMILY = {
    "Gemma": dict(head_dim=24),
    "Gemma2": dict(head_dim=16, attn_logit_softcapping=None, final_logit_softcapping=5.0, sliding_window=4,
                   query_pre_attn_scalar=20),
    "Gemma3": dict(head_dim=16, num_hidden_layers=7, num_key_value_heads=1, sliding_window=3, query_pre_attn_scalar=20,
                   final_logit_softcapping=8.0,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}),
}


@pytest.mark.parametrize("family", sorted(_GEMMA_FAMILY))
def test_hf_gemma_family_gives_transformers_logits(tmp_path: Path, family: str) -> None:
    """Gemma's (1 + weight) norms, scaled embeddings and GELU gate; Gemma 2/3's norms after each sublayer,
    query_pre_attn_scalar and sliding layers; Gemma 3's q/k norms and per-kind RoPE bases: transformers'
    logits, stepped across the windows."""
    hf = _saved_transformers_model(tmp_path, family, **_GEMMA_FAMILY[family])
    args = checkpoint.load_hf(tmp_path).args
    assert args.norm_offset and args.embed_scale and args.tie_embeddings and args.mlp_act == "gelu_tanh"
    if family != "Gemma":
        assert args.sandwich_norms and args.attention_scale == pytest.approx(20 ** -0.5)
    if family == "Gemma2":  # transformers' default: every other layer slides, the first one included
        assert [p.window for p in args.layer_policies()] == [4, 0]
    if family == "Gemma3":  # every sixth layer is full
        assert [p.window for p in args.layer_policies()] == [3, 3, 3, 3, 3, 0, 3]
        assert (args.local_rope_theta, args.rope_theta, args.rope_scaling) == \
            (100.0, 1e6, {"rope_type": "linear", "factor": 4.0})
    _eager_steps_give_transformers_logits(hf, checkpoint.load_hf(tmp_path), 8, [6, 1, 1, 3, 1, 1])


def test_hf_gemma_config_saying_gelu_computes_the_tanh_gelu_as_transformers_does(tmp_path: Path) -> None:
    """gemma-2b's released config.json says hidden_act "gelu"; transformers reads that legacy value as the tanh
    formula the model was trained with, and so does the loader."""
    hf = _saved_transformers_model(tmp_path, "Gemma", **_GEMMA_FAMILY["Gemma"])
    _edit_config(tmp_path, {"hidden_act": "gelu"})
    loaded = checkpoint.load_hf(tmp_path)
    assert loaded.args.mlp_act == "gelu_tanh"
    _eager_steps_give_transformers_logits(hf, loaded, 10, [4, 1, 2])


def test_hf_llama_with_the_exact_gelu_gives_transformers_logits(tmp_path: Path) -> None:
    """Outside Gemma, hidden_act "gelu" is transformers' exact erf GELU, which is not the tanh formula."""
    hf = _saved_transformers_model(tmp_path, "Llama", hidden_act="gelu", intermediate_size=160)
    loaded = checkpoint.load_hf(tmp_path)
    assert loaded.args.mlp_act == "gelu"
    _eager_steps_give_transformers_logits(hf, loaded, 11, [5, 1, 1])


def test_hf_granite_multipliers_give_transformers_logits(tmp_path: Path) -> None:
    """Granite's embedding, residual and attention multipliers and its logits divisor (none of them the
    Llama value; the attention's is not 1/sqrt(head_dim)), with MLP biases: transformers' logits."""
    hf = _saved_transformers_model(tmp_path, "Granite", embedding_multiplier=3.0, residual_multiplier=0.4,
                                   attention_multiplier=0.05, logits_scaling=2.5, mlp_bias=True, sliding_window=3)
    args = checkpoint.load_hf(tmp_path).args
    assert (args.embedding_multiplier, args.residual_multiplier, args.logits_scaling, args.attention_scale) == \
        (3.0, 0.4, 2.5, 0.05)
    assert args.mlp_bias and args.sliding_windows == [0]  # Granite's attention reads no window
    _eager_steps_give_transformers_logits(hf, checkpoint.load_hf(tmp_path), 12, [6, 1, 1, 2])


# SmolLM3's default special tokens (128,000 on) are past _HF_SMALL's vocabulary.
_SMOLLM3_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("config,nope,windows", [
    (dict(no_rope_layer_interval=2), [1, 3], [0]),
    (dict(no_rope_layers=[0, 1, 1, 0], use_sliding_window=True, sliding_window=3), [0, 3], [3, 0, 0, 3]),
    (dict(no_rope_layers=[0, 1, 1, 0], use_sliding_window=True, sliding_window=3, layer_types=None), [0, 3],
     [3, 0, 0, 3]),
    (dict(no_rope_layer_interval=2, use_sliding_window=False, sliding_window=3), [1, 3], [0]),
], ids=["nope-every-2nd", "listed-nope-sliding", "sliding-layers-unlisted", "window-off"])
def test_hf_smollm3_nope_layers_give_transformers_logits(tmp_path: Path, config: Dict[str, object],
                                                         nope: List[int], windows: List[int]) -> None:
    """SmolLM3's layers without RoPE (from its interval, or listed, 0 = NoPE), and sliding windows on
    them where the config turns them on: transformers' logits, stepped past the window."""
    hf = _saved_transformers_model(tmp_path, "SmolLM3", num_hidden_layers=4, max_position_embeddings=256,
                                   **_SMOLLM3_TOKENS, **{k: v for k, v in config.items() if k != "layer_types"})
    if "layer_types" in config:  # a config.json without the list (transformers derives it from the NoPE layers)
        _edit_config(tmp_path, drop=("layer_types",))
    args = checkpoint.load_hf(tmp_path).args
    assert args.nope_layers == nope and args.tie_embeddings
    assert [args.window_of(i) for i in range(4)] == (windows * 4 if len(windows) == 1 else windows)
    _eager_steps_give_transformers_logits(hf, checkpoint.load_hf(tmp_path), 13, [5, 1, 1, 3, 1])


def test_hf_olmo2_output_norms_and_full_width_qk_norms_give_transformers_logits(tmp_path: Path) -> None:
    """OLMo 2 normalises each sublayer's output (no input norms), q and k over all their heads at once before
    the split, and multiplies norm weights in fp32: transformers' logits in fp32, and close in bf16."""
    hf = _saved_transformers_model(tmp_path, "Olmo2", pad_token_id=0, eos_token_id=1)
    args = checkpoint.load_hf(tmp_path).args
    assert args.qk_norm and args.qk_norm_full and args.sandwich_norms and not args.pre_norms
    model = checkpoint.load_hf(tmp_path).model
    assert model.layers[0].attention.q_norm.weight.shape == (64,) and model.layers[0].attention.k_norm.weight.shape == (32,)
    _eager_steps_give_transformers_logits(hf, checkpoint.load_hf(tmp_path), 14, [5, 1, 2, 1])
    tokens = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        expected = hf.to(torch.bfloat16)(tokens, use_cache=False).logits.float()
    got = eager_steps(checkpoint.load_hf(tmp_path, dtype="bf16").model, tokens, [9])
    # bf16 rounds the attention differently from transformers' kernels: agreement to bf16's precision.
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("spelling", ["transformers-5", "transformers-4"])
def test_hf_olmo3_sliding_layers_and_rope_per_layer_kind_give_transformers_logits(tmp_path: Path,
                                                                                 spelling: str) -> None:
    """OLMo 3 is OLMo 2 with every fourth layer full and the others sliding, each kind with its own RoPE
    (linear scaling on the full layers only); 4.x configs gave rope_theta + rope_scaling for the full
    layers, and the sliding ones took the default base."""
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0}}
    hf = _saved_transformers_model(tmp_path, "Olmo3", num_hidden_layers=5, sliding_window=3, rope_parameters=rope,
                                   pad_token_id=0, eos_token_id=1)
    if spelling == "transformers-4":
        _edit_config(tmp_path, {"rope_theta": 1000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
                     drop=("rope_parameters", "layer_types"))
    args = checkpoint.load_hf(tmp_path).args
    assert [args.window_of(i) for i in range(5)] == [3, 3, 3, 0, 3]
    assert (args.rope_theta, args.local_rope_theta, args.rope_scaling) == \
        (1000.0, 500000.0, {"rope_type": "linear", "factor": 4.0})
    _eager_steps_give_transformers_logits(hf, checkpoint.load_hf(tmp_path), 16, [6, 1, 1, 2, 1])


def test_hf_rope_base_absent_from_the_config_is_the_familys_default(tmp_path: Path) -> None:
    """transformers' configs default the RoPE base per family (SmolLM3: 2e6): a config without one
    loads the same model transformers builds from it."""
    hf = _saved_transformers_model(tmp_path, "SmolLM3", **_SMOLLM3_TOKENS)
    assert _edit_config(tmp_path, drop=("rope_parameters",))["rope_parameters"]["rope_theta"] == 2e6
    assert checkpoint.load_hf(tmp_path).args.rope_theta == 2e6
    _eager_steps_give_transformers_logits(hf, checkpoint.load_hf(tmp_path), 17, [4, 1])


@pytest.mark.parametrize("family,update,named", [
    ("SmolLM3", {"no_rope_layers": [1, 2]}, r"no_rope_layers must list 0 or 1 for each of the 2 layers, got \[1, 2\]"),
    ("SmolLM3", {"no_rope_layers": [1]}, r"no_rope_layers must list 0 or 1 for each of the 2 layers"),
    ("Granite", {"logits_scaling": 0}, r"logits_scaling must be a finite number > 0, got 0"),
    ("Granite", {"attention_multiplier": -1.0}, r"attention_multiplier must be a finite number > 0"),
    ("Granite", {"residual_multiplier": "0.2"}, r"'residual_multiplier' must be a number, got '0.2'"),
])
def test_granite_and_smollm3_config_fields_that_cannot_be_a_model_are_named(
        tmp_path: Path, family: str, update: Dict[str, object], named: str) -> None:
    _saved_transformers_model(tmp_path, family, **(_SMOLLM3_TOKENS if family == "SmolLM3" else {}))
    _edit_config(tmp_path, update)
    with pytest.raises(ValueError, match=named):
        checkpoint.load_hf(tmp_path)


def test_hf_gemma3_config_in_transformers_4_spelling_loads_the_same_model(tmp_path: Path) -> None:
    """transformers 4.x wrote Gemma 3's RoPE as rope_theta + rope_local_base_freq + rope_scaling and often
    no layer_types (sliding_window_pattern, default 6): the same model as 5.x's nested rope_parameters."""
    hf = _saved_transformers_model(tmp_path, "Gemma3", **_GEMMA_FAMILY["Gemma3"])
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.pop("layer_types")
    config.update(rope_theta=rope["full_attention"]["rope_theta"], rope_scaling={"rope_type": "linear", "factor": 4.0},
                  rope_local_base_freq=rope["sliding_attention"]["rope_theta"], sliding_window_pattern=6)
    (tmp_path / "config.json").write_text(json.dumps(config))
    _eager_steps_give_transformers_logits(hf, checkpoint.load_hf(tmp_path), 9, [5, 1, 1, 1])


@pytest.mark.parametrize("update,named", [
    ({"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping is set"),
    ({"use_bidirectional_attention": True}, r"use_bidirectional_attention"),
    ({"hidden_activation": "relu"}, r"hidden_activation 'relu' is not supported"),
    ({"query_pre_attn_scalar": -4}, r"query_pre_attn_scalar must be a finite number > 0"),
])
def test_gemma2_configs_model_py_cannot_compute_are_named(tmp_path: Path, update: Dict[str, object],
                                                          named: str) -> None:
    """Gemma 2's attention softcap (tanh on the attention logits, the default when the field is absent), a
    bidirectional encoder, an unknown gate activation, a degenerate scale: refused by field, not loaded as
    another model."""
    _saved_transformers_model(tmp_path, "Gemma2", **_GEMMA_FAMILY["Gemma2"])
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, **update}))
    with pytest.raises(ValueError, match=named):
        checkpoint.load_hf(tmp_path)
    checkpoint.hf_args(saved)  # the saved config itself loads
    saved.pop("attn_logit_softcapping")  # absent: transformers' Gemma 2 default of 50 caps too
    with pytest.raises(ValueError, match=r"attn_logit_softcapping is set"):
        checkpoint.hf_args(saved)


def test_hf_phi3_fused_tensor_of_the_wrong_shape_or_unfused_names_are_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _saved_transformers_model(tmp_path, "Phi3", **_PHI3_SLIDING)
    weights = tmp_path / "model.safetensors"
    state = load_file(str(weights))
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    # q 64 + k 32 + v 32 rows of 64 inputs: a fused tensor short of one part's rows is refused by name.
    save_file({**state, qkv: state[qkv][:96].contiguous()}, str(weights))
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.qkv_proj\.weight'.*shape \(96, 64\).*\(128, 64\)"):
        checkpoint.load_hf(tmp_path)
    # Llama's unfused names are not Phi-3's: transformers would not read them.
    unfused = {k: v for k, v in state.items() if k != qkv}
    unfused.update({"model.layers.1.self_attn.q_proj.weight": state[qkv][:64].contiguous(),
                    "model.layers.1.self_attn.k_proj.weight": state[qkv][64:96].contiguous(),
                    "model.layers.1.self_attn.v_proj.weight": state[qkv][96:].contiguous()})
    save_file(unfused, str(weights))
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.[qkv]_proj\.weight'.*not used"):
        checkpoint.load_hf(tmp_path)
    # Its missing fused tensor is named as Phi-3 stores it.
    save_file({k: v for k, v in state.items() if k != qkv}, str(weights))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.self_attn\.qkv_proj\.weight'"):
        checkpoint.load_hf(tmp_path)


def _logits_agree_with_transformers_reading_our_writer(tmp_path: Path, loaded: "checkpoint.LoadedCheckpoint",
                                                      tokens: torch.Tensor) -> None:
    """hf_config + to_hf_state_dict of ``loaded``, read by transformers itself, give ``loaded``'s logits
    (so the config writes every field transformers needs to build the same model)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    tmp_path.mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps(checkpoint.hf_config(loaded.args)))
    save_file(checkpoint.to_hf_state_dict(loaded.model), str(tmp_path / "model.safetensors"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        expected = theirs(tokens, use_cache=False).logits
    torch.testing.assert_close(eager_steps(loaded.model, tokens, [tokens.shape[1]]), expected, atol=2e-5, rtol=1e-4)


def test_hf_llama_mlp_bias_gives_transformers_logits(tmp_path: Path) -> None:
    """Llama's mlp_bias: biases on the gate, up and down projections; written back by hf_config."""
    hf = _saved_transformers_model(tmp_path / "ckpt", "Llama", mlp_bias=True)
    loaded = checkpoint.load_hf(tmp_path / "ckpt")
    assert loaded.args.mlp_bias and not loaded.args.qkv_bias
    assert loaded.model.layers[1].feed_forward.w2.bias is not None
    tokens = _eager_steps_give_transformers_logits(hf, loaded, 6, [5, 1, 3])
    assert checkpoint.hf_config(loaded.args)["mlp_bias"] is True
    _logits_agree_with_transformers_reading_our_writer(tmp_path / "ours", loaded, tokens)


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling-4.x"])
def test_hf_linear_rope_scaling_gives_transformers_logits(tmp_path: Path, spelling: str) -> None:
    """rope_type linear: positions divided by the factor. transformers 5 writes rope_parameters;
    4.x configs say rope_scaling {"type": "linear"}, which must read the same."""
    hf = _saved_transformers_model(tmp_path / "ckpt", "Llama",
                                   rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    if spelling != "rope_parameters":
        config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
        config.pop("rope_parameters")
        config.update(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 4.0})
        (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    loaded = checkpoint.load_hf(tmp_path / "ckpt")
    assert loaded.args.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    tokens = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = hf(tokens, use_cache=False).logits
    got = eager_steps(loaded.model, tokens, [12, 1, 1, 6])
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    # The scaling matters at these positions (the comparison would be blind otherwise).
    plain = checkpoint.build_model(ModelArgs(**{**loaded.args.to_dict(), "rope_scaling": None}),
                                   loaded.model.state_dict())[0]
    assert (eager_steps(plain, tokens, [20]) - expected).abs().max() > 1e-2
    _logits_agree_with_transformers_reading_our_writer(tmp_path / "ours", loaded, tokens)


@pytest.mark.parametrize("attention_bias", [False, True], ids=["no-bias", "attention-bias"])
def test_hf_qwen3_with_qk_norms_gives_transformers_logits(tmp_path: Path, attention_bias: bool) -> None:
    """Qwen3: per-head q/k RMSNorms before RoPE, an explicit head_dim, Qwen2's sliding layers,
    attention_bias on all four projections."""
    hf = _saved_transformers_model(tmp_path / "ckpt", "Qwen3", attention_bias=attention_bias, **_QWEN3_SLIDING)
    loaded = checkpoint.load_hf(tmp_path / "ckpt")
    a = loaded.args
    assert a.qk_norm and a.head_dim == 24 and (a.qkv_bias, a.out_bias) == (attention_bias, attention_bias)
    assert [p.window for p in a.layer_policies()] == [0, 4]
    assert loaded.model.layers[0].attention.q_norm.weight.shape == (24,)
    tokens = _eager_steps_give_transformers_logits(hf, loaded, 8, [5, 1, 1, 3, 1, 1])
    config = checkpoint.hf_config(a)
    assert (config["architectures"], config["attention_bias"]) == (["Qwen3ForCausalLM"], attention_bias)
    _logits_agree_with_transformers_reading_our_writer(tmp_path / "ours", loaded, tokens)


def test_hf_qwen3_without_head_dim_takes_transformers_default(tmp_path: Path) -> None:
    # Qwen3Config's head_dim defaults to 128 (not hidden_size / heads): a config without one means 128.
    d = _write_hf(tmp_path, tiny_args(qk_norm=True, attention_head_dim=128), config_update={"head_dim": None})
    assert checkpoint.load_hf(d).args.head_dim == 128


def test_hf_unsupported_rope_mlp_bias_and_qwen3_settings_are_refused_naming_the_field() -> None:
    cases = {
        "yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        "dynamic 4.x": ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
        "linear without factor": ({"rope_scaling": {"rope_type": "linear"}},
                                  r"rope scaling \(linear\) has no 'factor'"),
        "linear factor 0": ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "'factor' must be positive"),
        "partial rotary": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5"),
        "mlp_bias on qwen2": ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "mlp_bias": True},
                              "mlp_bias=true, which Qwen2ForCausalLM does not read"),
        "mlp_bias not a bool": ({"mlp_bias": "yes"}, "'mlp_bias' must be true or false, got 'yes'"),
    }
    for update, message in cases.values():
        with pytest.raises(ValueError, match=message):
            checkpoint.hf_args({**checkpoint.hf_config(tiny_args()), **update})
    # Shapes a Hugging Face config cannot state are refused when writing one, not written wrong.
    with pytest.raises(ValueError, match="Qwen2ForCausalLM config has no MLP biases"):
        checkpoint.hf_config(tiny_args(qkv_bias=True, mlp_bias=True))
    with pytest.raises(ValueError, match="Qwen3 config has q/k/v biases only with an output-projection bias"):
        checkpoint.hf_config(tiny_args(qk_norm=True, qkv_bias=True))


def test_hf_damaged_or_quantized_checkpoints_are_refused_naming_the_problem(tmp_path: Path) -> None:
    def drop(key: str):  # noqa: ANN202
        return lambda c: c.pop(key)

    config_cases = {
        "no hidden_size": (drop("hidden_size"), "config.json has no 'hidden_size'"),
        "llama3 without low_freq_factor": (
            lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64}),
            "has no 'low_freq_factor'"),
        "quantized": (lambda c: c.update(quantization_config={"quant_method": "bitsandbytes"}),
                      "quantization_config .bitsandbytes."),
        "negative sliding window": (lambda c: c.update(sliding_window=-3), "sliding_window must be positive"),
        # Values no model computes with, and a damaged layer count (refused before a block is built).
        "rope_theta 0": (lambda c: c.update(rope_theta=0), "rope_theta. must be a finite number > 0, got 0.0"),
        "rms_norm_eps -1": (lambda c: c.update(rms_norm_eps=-1), "RMSNorm epsilon must be a finite number >= 0"),
        "llama3 low == high": (
            lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                                             "high_freq_factor": 2.0, "original_max_position_embeddings": 64}),
            "needs low_freq_factor != high_freq_factor"),
        "a million layers": (lambda c: c.update(num_hidden_layers=10**6), "states 1000000 layers, its tensors hold only 2"),
    }
    for name, (edit, message) in config_cases.items():
        d = _write_hf(tmp_path / name.replace(" ", "_"), tiny_args())
        config = json.loads((d / "config.json").read_text())
        edit(config)
        (d / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            checkpoint.load_hf(d)

    d = _write_hf(tmp_path / "list", tiny_args())
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        checkpoint.load_hf(d)

    def int8_codes(state: Dict[str, torch.Tensor]) -> None:
        w = state["model.layers.0.mlp.up_proj.weight"]
        state["model.layers.0.mlp.up_proj.weight"] = (w * 100).clamp(-127, 127).to(torch.int8)

    d = _write_hf(tmp_path / "int8", tiny_args(), mutate=int8_codes)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight'.*stored as torch\.int8"):
        checkpoint.load_hf(d)

    d = _write_hf(tmp_path / "truncated", tiny_args())
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="model.safetensors is not a readable weights file"):
        checkpoint.load_hf(d)


def test_meta_missing_and_misshapen_tensors_are_named(tmp_path: Path) -> None:
    state = checkpoint.to_meta_state_dict(_meta_reference_model())
    missing = dict(state)
    missing.pop("layers.1.attention.wo.weight")
    with pytest.raises(ValueError, match=r"missing tensor 'layers\.1\.attention\.wo\.weight'"):
        checkpoint.load_meta(_write_meta(tmp_path / "missing", missing, META_PARAMS))
    misshapen = dict(state)
    misshapen["layers.0.attention.wq.weight"] = torch.zeros(32, 64)
    with pytest.raises(ValueError, match=r"'layers\.0\.attention\.wq\.weight' has shape \(32, 64\)"):
        checkpoint.load_meta(_write_meta(tmp_path / "misshapen", misshapen, META_PARAMS))


# --------------------------------------------------------------------------- #
# Tokenizers
# --------------------------------------------------------------------------- #


def test_byte_tokenizer_round_trips_utf8_with_bos_and_eos_ids() -> None:
    tok = tokenizer.load_tokenizer(None)
    ids = tok.encode("héllo ✓")
    assert ids[0] == tokenizer.BYTE_BOS and max(ids) < tokenizer.BYTE_VOCAB_SIZE
    assert tok.decode(ids + [tokenizer.BYTE_EOS]) == "héllo ✓"
    assert tok.stop_ids() == [tokenizer.BYTE_EOS]


def test_hf_tokenizer_json_encodes_decodes_and_renders_its_chat_template(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers, trainers

    t = HFTok(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.train_from_iterator(["hello world", "hello there", "world of tokens", "user says"] * 10,
                          trainers.BpeTrainer(special_tokens=["<unk>", "<s>", "</s>", "<|eot_id|>"]))
    t.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>"},
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}there{% endif %}",
    }))
    tok = tokenizer.load_tokenizer(tmp_path)  # a directory finds tokenizer.json
    assert tok.kind == "hf"
    ids = tok.encode("hello world")
    assert ids[0] == tok.bos_id == t.token_to_id("<s>")
    assert tok.decode(ids) == "hello world"
    assert set(tok.stop_ids()) == {t.token_to_id("</s>"), t.token_to_id("<|eot_id|>")}
    chat = tok.chat_prompt("hello")
    assert chat[0] == tok.bos_id and tok.decode(chat).replace(" ", "") == "userhellothere"


def test_tiktoken_model_file_loads_as_llama3_tokenizer(tmp_path: Path) -> None:
    import base64

    path = tmp_path / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    tok = tokenizer.load_tokenizer(path)  # not SentencePiece, so tiktoken
    assert tok.kind == "tiktoken"
    ids = tok.encode("hi!")
    assert ids[0] == tok.bos_id and tok.decode(ids) == "hi!"
    assert len(tok.stop_ids()) >= 2  # <|end_of_text|> and <|eot_id|>


# --------------------------------------------------------------------------- #
# export.py + run.py through the .pte
# --------------------------------------------------------------------------- #

TOY = ["--tiny", "--dim", "64", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2"]
PROMPT = "The quick brown fox jumps over the lazy dog; offgraph-kv!"  # 57 bytes + BOS


@pytest.fixture(scope="session")
def toy_pte(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llama") / "toy.pte"
    rc = export.main(["--out", str(out), *TOY, "--storage-dtype", "fp32", "--initial-capacity", "16",
                      "--max-write", "16", "--quiet"])
    assert rc == 0
    return out


def _toy_model() -> Transformer:
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=tokenizer.BYTE_VOCAB_SIZE)
    return init_deterministic(Transformer(args), seed=0).eval()


def test_rope_frequencies_stay_fp32_when_the_weights_are_cast() -> None:
    fp32 = _toy_model()
    for dtype in (torch.bfloat16, torch.float16):
        cast = _toy_model().to(dtype)
        assert cast.tok_embeddings.weight.dtype == dtype
        assert cast.inv_freq.dtype == torch.float32
        assert torch.equal(cast.inv_freq, fp32.inv_freq)


def test_export_writes_a_sidecar_and_no_kv_bytes(toy_pte: Path, capsys: pytest.CaptureFixture) -> None:
    side = json.loads(export.sidecar_path(toy_pte).read_text())
    assert side["max_write"] == 16 and side["storage_dtype"] == "fp32"
    assert side["tokenizer"]["kind"] == "bytes"
    assert side["file_bytes"] == toy_pte.stat().st_size
    assert side["parameters"] == sum(p.numel() for p in _toy_model().parameters())
    # 2 layers x (K + V) x 2 kv heads x 16 head dim x 4 bytes
    assert side["kv_bytes_per_token"] == 512
    # Read back from the file: every named-data byte is the code or a weight a manifest lists.
    scan = side["pte_scan"]
    # (identical weights, e.g. norms initialised to ones, are stored once)
    assert scan["code_bytes"] > 0 and 0.9 * side["weight_bytes"] < scan["weight_bytes"] <= side["weight_bytes"]
    assert scan["named_data_bytes"] == scan["code_bytes"] + scan["weight_bytes"]
    assert side["kv_bytes_in_file"] == scan["unclaimed_named_data_bytes"] == 0
    export.print_summary(side)
    assert "kv bytes in file: 0" in capsys.readouterr().out


def _eager_greedy(model: Transformer, prompt: List[int], n: int) -> List[int]:
    out: List[int] = []
    with reference_cache(model.args):
        logits = model(torch.tensor([prompt]), positions(0, len(prompt)))
        pos = len(prompt)
        while True:
            out.append(int(logits[0, -1].argmax()))
            if len(out) == n:
                return out
            logits = model(torch.tensor([[out[-1]]]), positions(pos, 1))
            pos += 1


def test_exported_program_returns_only_the_last_tokens_logits_by_default(toy_pte: Path) -> None:
    # export.py's default (ExecuTorch's export_llama does the same): a step
    # returns the last token's logits, [1, 1, vocab], equal to that row of the
    # eager model's full logits; its output projection is a one-row reduction.
    import offgraph_kv.runtime

    assert json.loads(export.sidecar_path(toy_pte).read_text())["model_args"]["full_logits"] is False
    method = offgraph_kv.runtime.load_method(toy_pte)
    model = _toy_model()
    prompt = torch.tensor([tokenizer.ByteTokenizer().encode("last logits")])
    t = prompt.shape[1]
    with reference_cache(model.args), torch.no_grad():
        for tokens, start in ((prompt, 0), (torch.tensor([[7]]), t), (torch.tensor([[9, 11, 13]]), t + 1)):
            got = method.execute([tokens, positions(start, tokens.shape[1])])[0]
            want = model(tokens, positions(start, tokens.shape[1]))
            assert got.shape == (1, 1, tokenizer.BYTE_VOCAB_SIZE) and want.shape[1] == tokens.shape[1]
            torch.testing.assert_close(got, want[:, -1:], rtol=1e-4, atol=1e-4)


def test_run_generates_the_eager_greedy_tokens_across_growths(toy_pte: Path, tmp_path: Path) -> None:
    report = tmp_path / "run.json"
    rc = run.main([str(toy_pte), "--prompt", PROMPT, "--max-new-tokens", "24", "--ignore-stop",
                   "--check", "--json", str(report), "--quiet"])
    assert rc == 0
    r = json.loads(report.read_text())
    prompt = tokenizer.ByteTokenizer().encode(PROMPT)
    assert r["prompt_ids"] == prompt
    assert r["generated_ids"] == _eager_greedy(_toy_model(), prompt, 24)
    assert r["stop_reason"] == "max_new_tokens"
    assert r["check"]["argmax_mismatches"] == 0 and r["check"]["max_abs_diff"] < 1e-4
    m = r["metrics"]
    # The last generated token is never fed back, so it holds no cache row.
    assert m["length"] == len(prompt) + 24 - 1 == 81
    assert m["capacity"] == 128 and m["growths"] == 3  # 16 -> 32 -> 64 -> 128
    assert [layer["kind"] for layer in m["layers"]] == ["flat", "flat"]
    assert r["timings"]["decode_steps"] == 23 and r["timings"]["prefill_tokens"] == len(prompt)


def test_run_under_another_torch_goes_through_the_cpp_module_with_the_same_tokens(
        toy_pte: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OFFGRAPH_KV_HOST_RUNNER", "1")  # what a torch other than 2.13 gets
    report = tmp_path / "run.json"
    rc = run.main([str(toy_pte), "--prompt", PROMPT, "--max-new-tokens", "24", "--ignore-stop", "--check",
                   "--json", str(report), "--quiet"])
    assert rc == 0
    r = json.loads(report.read_text())
    assert r["generated_ids"] == _eager_greedy(_toy_model(), tokenizer.ByteTokenizer().encode(PROMPT), 24)
    assert r["check"]["argmax_mismatches"] == 0 and r["metrics"]["growths"] == 3


def test_run_stops_cleanly_when_the_cache_is_full(toy_pte: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    report = tmp_path / "run.json"
    rc = run.main([str(toy_pte), "--prompt", "short prompt", "--max-new-tokens", "500", "--ignore-stop",
                   "--max-capacity", "40", "--json", str(report), "--quiet"])
    assert rc == 0
    r = json.loads(report.read_text())
    assert r["stop_reason"] == "capacity"
    assert r["metrics"]["length"] == 40 and r["metrics"]["max_capacity"] == 40
    assert len(r["generated_ids"]) == 40 - len(r["prompt_ids"]) + 1
    assert "KV cache is full" in capsys.readouterr().err


def test_run_refuses_a_prompt_longer_than_the_capacity(toy_pte: Path, capsys: pytest.CaptureFixture) -> None:
    rc = run.main([str(toy_pte), "--prompt", "x" * 60, "--max-capacity", "32", "--quiet"])
    assert rc == 1
    assert "the prompt has 61 tokens but the KV cache has room for 32" in capsys.readouterr().err


@pytest.mark.parametrize("args, named", [
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--temperature", "1", "--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--prompt", "ab\udcff"], "--prompt is not valid UTF-8"),  # an undecodable argv byte, as Python hands it over
], ids=["temperature-nan", "top-p-0", "prompt-not-utf8"])
def test_run_refuses_bad_sampling_and_prompt_arguments_naming_them(toy_pte: Path, capsys: pytest.CaptureFixture,
                                                                    args: list, named: str) -> None:
    assert run.main([str(toy_pte), "--quiet", *args]) == 2
    assert named in capsys.readouterr().err


def test_export_refuses_bad_toy_arguments_and_a_broken_tokenizer_naming_them(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture) -> None:
    out = str(tmp_path / "x.pte")
    for windows in ("3,3,3", "-1", "a"):
        assert export.main(["--out", out, *TOY, f"--sliding-windows={windows}"]) == 2
        assert f"--sliding-windows {windows!r}" in capsys.readouterr().err
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{bad")
    with pytest.raises(ValueError, match="is not a readable tokenizer.json"):
        tokenizer.load_tokenizer(broken)


def test_generation_ends_at_a_stop_token(toy_pte: Path) -> None:
    import offgraph_kv.runtime as rt

    prompt = tokenizer.ByteTokenizer().encode(PROMPT)
    first = _eager_greedy(_toy_model(), prompt, 1)[0]
    method = rt.load_method(toy_pte)
    g = run.generate(method, rt.stores()[-1], prompt, max_write=16, max_new_tokens=10, stop_ids=[first],
                     pick=lambda logits: int(logits.argmax()))
    assert g.generated_ids == [first] and g.stop_reason == "stop_token"


def test_sampling_is_reproducible_from_the_seed_and_respects_top_p() -> None:
    logits = torch.tensor([5.0, 4.9, -10.0, -10.0])
    picks = {run.sample(logits, 1.0, 0.9, torch.Generator().manual_seed(s)) for s in range(50)}
    assert picks == {0, 1}  # the two tokens holding >= 90% of the mass, never the tail
    a = [run.sample(logits, 1.0, 1.0, torch.Generator().manual_seed(7)) for _ in range(3)]
    b = [run.sample(logits, 1.0, 1.0, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert a == b
    assert run.sample(logits, 0.0, 0.9, torch.Generator()) == 0


def _runs_like_transformers(pte: Path, hf: "torch.nn.Module", seed: int, grows: bool = True) -> None:
    """``pte`` in the ExecuTorch runtime (initial capacity 8, so a flat layer grows): a 10-token prefill, then
    14 decode steps, each step's last logits against transformers' over the same 24 tokens."""
    import offgraph_kv.runtime

    offgraph_kv.runtime.configure(initial_capacity=8)
    try:
        method = offgraph_kv.runtime.load_method(pte)
    finally:
        offgraph_kv.runtime.configure()
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = hf(ids, use_cache=False).logits[0, 9:]
    got = [method.execute([ids[:, :10], positions(0, 10)])[0][0, -1]]
    for i in range(10, 24):
        got.append(method.execute([ids[:, i:i + 1], positions(i, 1)])[0][0, -1])
    torch.testing.assert_close(torch.stack(got), want, atol=1e-4, rtol=1e-4)
    assert (offgraph_kv.runtime.stores()[-1].metrics()["growths"] >= 1) == grows


def test_qwen2_checkpoint_exported_from_its_directory_gives_transformers_logits(tmp_path: Path) -> None:
    """A Hugging Face Qwen2 directory (q/k/v biases, tied embeddings, a flat layer then a sliding-window
    one) through export.py --hf-dir and the ExecuTorch runtime: transformers' logits across the window
    and a growth."""
    hf = _saved_transformers_model(tmp_path / "ckpt", "Qwen2", seed=1, **_QWEN2_SLIDING)
    out = tmp_path / "qwen2.pte"
    assert export.main(["--hf-dir", str(tmp_path / "ckpt"), "--out", str(out), "--dtype", "fp32",
                        "--storage-dtype", "fp32", "--max-write", "16", "--quiet"]) == 0
    _runs_like_transformers(out, hf, seed=5)


def test_phi3_checkpoint_exported_from_its_directory_gives_transformers_logits(tmp_path: Path) -> None:
    """A Hugging Face Phi-3 directory (fused q/k/v and gate/up, a sliding window on every layer) through
    export.py --hf-dir and the ExecuTorch runtime: transformers' logits as the rings wrap (no layer grows)."""
    hf = _saved_transformers_model(tmp_path / "ckpt", "Phi3", seed=3, **_PHI3_SLIDING)
    out = tmp_path / "phi3.pte"
    assert export.main(["--hf-dir", str(tmp_path / "ckpt"), "--out", str(out), "--dtype", "fp32",
                        "--storage-dtype", "fp32", "--max-write", "16", "--quiet"]) == 0
    _runs_like_transformers(out, hf, seed=7, grows=False)


def test_gemma3_checkpoint_exported_from_its_directory_gives_transformers_logits(tmp_path: Path) -> None:
    """A Hugging Face Gemma 3 directory (offset norms, scaled embeddings, GELU, four norms a block, q/k norms,
    a RoPE base per layer kind, one KV head, a final logit cap) through export.py --hf-dir and the
    ExecuTorch runtime: transformers' logits across the windows and a growth; the sidecar reads back."""
    hf = _saved_transformers_model(tmp_path / "ckpt", "Gemma3", seed=4, **_GEMMA_FAMILY["Gemma3"])
    out = tmp_path / "gemma3.pte"
    assert export.main(["--hf-dir", str(tmp_path / "ckpt"), "--out", str(out), "--dtype", "fp32",
                        "--storage-dtype", "fp32", "--max-write", "16", "--quiet"]) == 0
    side = json.loads(export.sidecar_path(out).read_text())["model_args"]
    # The same model (export chose to hand back the last position's logits only).
    assert run.model_args_from_json(side, "sidecar") == \
        dataclasses.replace(checkpoint.load_hf(tmp_path / "ckpt").args, full_logits=side["full_logits"])
    _runs_like_transformers(out, hf, seed=8)


# Families exported from their directories: what each adds to the lowered graph, and what its sidecar holds.
_EXPORTED_FAMILIES = {
    # NoPE layers that are also sliding-window rings, the others flat with RoPE; tied embeddings.
    "SmolLM3": (dict(num_hidden_layers=3, max_position_embeddings=256, no_rope_layers=[1, 0, 1],
                     use_sliding_window=True, sliding_window=4, **_SMOLLM3_TOKENS),
                {"nope_layers": [1], "sliding_windows": [0, 4, 0]}),
    # Output norms only, q/k norms over whole projections.
    "Olmo2": (dict(pad_token_id=0, eos_token_id=1), {"pre_norms": False, "qk_norm_full": True}),
    # Multipliers on the embeddings, residuals, softmax and logits.
    "Granite": (dict(embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.05, logits_scaling=2.5),
                {"logits_scaling": 2.5, "attention_scale": 0.05}),
}


@pytest.mark.parametrize("family", sorted(_EXPORTED_FAMILIES))
def test_checkpoint_of_another_family_exported_from_its_directory_gives_transformers_logits(tmp_path: Path,
                                                                                           family: str) -> None:
    """A Hugging Face directory of each family through export.py --hf-dir and the ExecuTorch runtime:
    transformers' logits across a window and a growth; the sidecar reads back as the same model."""
    config, in_sidecar = _EXPORTED_FAMILIES[family]
    hf = _saved_transformers_model(tmp_path / "ckpt", family, seed=5, **config)
    out = tmp_path / f"{family}.pte"
    assert export.main(["--hf-dir", str(tmp_path / "ckpt"), "--out", str(out), "--dtype", "fp32",
                        "--storage-dtype", "fp32", "--max-write", "16", "--quiet"]) == 0
    side = json.loads(export.sidecar_path(out).read_text())["model_args"]
    assert {k: side[k] for k in in_sidecar} == in_sidecar
    assert run.model_args_from_json(side, "sidecar") == \
        dataclasses.replace(checkpoint.load_hf(tmp_path / "ckpt").args, full_logits=side["full_logits"])
    _runs_like_transformers(out, hf, seed=9)


def test_qwen3_checkpoint_exported_from_its_directory_gives_transformers_logits(tmp_path: Path) -> None:
    """A Hugging Face Qwen3 directory (per-head q/k norms, head_dim 24 on a 64-wide stream, linear RoPE
    scaling, tied embeddings, a flat layer then a sliding-window one) through export.py --hf-dir and the
    ExecuTorch runtime: transformers' logits across the window and a growth."""
    hf = _saved_transformers_model(tmp_path / "ckpt", "Qwen3", seed=2, **_QWEN3_SLIDING)
    out = tmp_path / "qwen3.pte"
    assert export.main(["--hf-dir", str(tmp_path / "ckpt"), "--out", str(out), "--dtype", "fp32",
                        "--storage-dtype", "fp32", "--max-write", "16", "--quiet"]) == 0
    side = json.loads(export.sidecar_path(out).read_text())["model_args"]
    assert side["qk_norm"] and side["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    _runs_like_transformers(out, hf, seed=6)
