"""Weight-only int8 / int4 quantization (torchao) composes with the partitioner.

The example's ``export.py --quantize`` quantizes every linear layer before
export; the compiled program must give the torchao-quantized eager model's
results (``run.py --check`` runs that model over ExecuTorch's reference cache
beside the .pte), and the .pte must carry the weights as integers outside the
code. The model here is not the example's default shape: 6 q / 2 kv heads of
16, one sliding-window layer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict

import pytest
import torch
from conftest import REPO

LLAMA_DIR = REPO / "examples" / "llama"
if str(LLAMA_DIR) not in sys.path:
    sys.path.insert(0, str(LLAMA_DIR))

import export  # noqa: E402
import run  # noqa: E402
from model import ModelArgs, Transformer, init_deterministic  # noqa: E402
from quantize import quantize_model, weight_bytes  # noqa: E402
from tokenizer import BYTE_VOCAB_SIZE  # noqa: E402

SHAPE = ["--tiny", "--dim", "96", "--n-layers", "2", "--n-heads", "6", "--n-kv-heads", "2", "--sliding-windows", "0,12"]
PROMPT = "Quantized weights, the same answers: 0123456789."
TOL_BF16 = 0.1  # compiled bf16 against eager bf16: rounding of fused kernels, not of the quantization


def _unquantized_bytes() -> int:
    args = ModelArgs(dim=96, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=BYTE_VOCAB_SIZE, sliding_windows=[0, 12])
    return weight_bytes(init_deterministic(Transformer(args), seed=0))


# int8 in a bf16 model (the int8 GEMM), int4 in an fp32 one (torchao's dequantize and matmul).
@pytest.fixture(scope="module", params=[("int8", "bf16"), ("int4", "fp32")], ids=["int8-bf16", "int4-fp32"])
def quantized_pte(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    scheme, dtype = request.param
    out = tmp_path_factory.mktemp(f"quantized_{scheme}") / "q.pte"
    rc = export.main(["--out", str(out), *SHAPE, "--quantize", scheme, "--group-size", "32", "--dtype", dtype,
                      "--storage-dtype", "fp32", "--initial-capacity", "16", "--max-write", "8", "--quiet"])
    assert rc == 0
    return out


def _sidecar(pte: Path) -> Dict[str, object]:
    return json.loads(export.sidecar_path(pte).read_text())


def test_quantized_program_generates_the_torchao_eager_models_tokens_and_logits(quantized_pte: Path,
                                                                               tmp_path: Path) -> None:
    report = tmp_path / "run.json"
    rc = run.main([str(quantized_pte), "--prompt", PROMPT, "--max-new-tokens", "20", "--ignore-stop",
                   "--check", "--json", str(report), "--quiet"])
    assert rc == 0
    r = json.loads(report.read_text())
    # The eager reference is rebuilt from the sidecar and quantized the same way
    # (teacher-forced on the program's tokens). In bf16 the two round differently
    # (fused kernels keep fp32 inside), so an argmax may flip where two logits
    # of this random model are within that rounding of each other.
    if _sidecar(quantized_pte)["weights_dtype"] == "bf16":
        assert r["check"]["max_abs_diff"] < TOL_BF16 and r["check"]["argmax_mismatches"] <= 3, r["check"]
    else:
        assert r["check"]["max_abs_diff"] < 1e-4 and r["check"]["argmax_mismatches"] == 0, r["check"]
    assert r["metrics"]["growths"] >= 2  # prompt and answer cross 16 -> 32 -> 64 -> 128 rows
    assert [layer["kind"] for layer in r["metrics"]["layers"]] == ["flat", "ring"]


def test_quantized_weights_are_stored_as_integers_outside_the_code(quantized_pte: Path) -> None:
    side = _sidecar(quantized_pte)
    scheme = side["quantize"]["scheme"]
    assert side["quantize"]["linears"] == 2 * 7 + 1  # q k v o, three FFN, per layer; the output projection
    assert side["quantize"]["group_size"] == (32 if scheme == "int4" else None)
    scan = side["pte_scan"]
    # int8 bytes plus fp32 scales for every linear; the byte embedding and norms stay fp32.
    assert scan["weight_bytes"] < 0.45 * _unquantized_bytes()
    assert 0.9 * side["weight_bytes"] < scan["weight_bytes"] <= side["weight_bytes"]
    assert scan["named_data_bytes"] == scan["code_bytes"] + scan["weight_bytes"]
    assert side["kv_bytes_in_file"] == 0


def test_int8_linears_of_a_bf16_model_run_by_the_int8_gemm_give_torchao_eager_results() -> None:
    dtype = torch.bfloat16
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    def model() -> Transformer:
        args = ModelArgs(dim=96, n_layers=1, n_heads=6, n_kv_heads=2, vocab_size=64, multiple_of=32)
        return init_deterministic(Transformer(args), seed=4).eval().to(dtype)

    ours, theirs = model(), model()
    quantize_model(ours, "int8")
    quantize_(theirs, Int8WeightOnlyConfig())  # torchao's own tensor: dequantize, then a float matmul
    x = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(0)).to(dtype)
    for name in ("attention.wq", "attention.wv", "feed_forward.w2"):
        a, b = ours.layers[0].get_submodule(name), theirs.layers[0].get_submodule(name)
        assert type(a).__name__ == "Int8RowLinear" and a.qdata.dtype == torch.int8
        inp = x if a.in_features == 96 else torch.randn(3, 5, a.in_features).to(dtype)
        want = b(inp).float()
        torch.testing.assert_close(a(inp).float(), want, atol=2 ** -7 * float(want.abs().max()), rtol=0)


def test_quantize_names_an_unknown_scheme_and_a_group_size_that_does_not_divide(tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture) -> None:
    model = init_deterministic(Transformer(ModelArgs(dim=96, n_layers=1, n_heads=6, n_kv_heads=2, vocab_size=64)), seed=0)
    with pytest.raises(ValueError, match="unknown scheme 'int3'; expected one of int8, int4"):
        quantize_model(model, "int3")
    with pytest.raises(ValueError, match=r"group size 64 does not divide the inputs of layers\.0\.attention\.wq \(96"):
        quantize_model(model, "int4", 64)
    assert type(model.layers[0].attention.wq.weight.data) is torch.Tensor  # refused before changing anything
    rc = export.main(["--out", str(tmp_path / "x.pte"), *SHAPE, "--quantize", "int4", "--group-size", "40", "--quiet"])
    assert rc == 2
    assert "group size 40 does not divide" in capsys.readouterr().err
    assert not (tmp_path / "x.pte").exists()
