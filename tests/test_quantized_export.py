"""int8 / int4 weight-only and 8da4w (int8 dynamic activations, int4 weights)
quantization (torchao) composes with the partitioner.

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
from quantize import GROUPED, quantize_model, weight_bytes  # noqa: E402

from offgraph_kv.backend import quantized_linear as ql
from tokenizer import BYTE_VOCAB_SIZE  # noqa: E402

SHAPE = ["--tiny", "--dim", "96", "--n-layers", "2", "--n-heads", "6", "--n-kv-heads", "2", "--sliding-windows", "0,12"]
PROMPT = "Quantized weights, the same answers: 0123456789."
TOL_BF16 = 0.1  # compiled bf16 against eager bf16: rounding of fused kernels, not of the quantization
TOL_DYNAMIC = 0.15  # 8da4w / 8da8w: a few 8-bit activation roundings that flip (below)


def _unquantized_bytes() -> int:
    args = ModelArgs(dim=96, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=BYTE_VOCAB_SIZE, sliding_windows=[0, 12])
    return weight_bytes(init_deterministic(Transformer(args), seed=0))


# int8 in a bf16 model (wider steps: the int8 GEMM) and in an fp32 one (dequantize + mm), int4 packed in an
# fp32 one (one-row steps of these three: our kernels over the stored integers); 8da4w in an fp32 one and
# 8da8w (every width: the integer-dot kernels).
@pytest.fixture(scope="module", params=[("int8", "bf16"), ("int8", "fp32"), ("int4", "fp32"), ("8da4w", "fp32"),
                                        ("8da8w", "fp32")],
                ids=["int8-bf16", "int8-fp32", "int4-fp32", "8da4w-fp32", "8da8w-fp32"])
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
    elif _sidecar(quantized_pte)["quantize"]["scheme"] in ("8da4w", "8da8w"):
        # Activations rounded to 8 bits: where the compiled and the eager fp32 sums differ in the last bit
        # next to a rounding boundary, one activation lands a step (1/255 of its row's range) away. Measured
        # on this model, 8da4w: every step within 1e-6 but one prefill row (0.017) and one decode step whose
        # K/V then stays in the cache (0.058 there, ~0.035 after).
        assert r["check"]["max_abs_diff"] < TOL_DYNAMIC and r["check"]["argmax_mismatches"] == 0, r["check"]
    else:
        assert r["check"]["max_abs_diff"] < 1e-4 and r["check"]["argmax_mismatches"] == 0, r["check"]
    assert r["metrics"]["growths"] >= 2  # prompt and answer cross 16 -> 32 -> 64 -> 128 rows
    assert [layer["kind"] for layer in r["metrics"]["layers"]] == ["flat", "ring"]


def test_quantized_weights_are_stored_as_integers_outside_the_code(quantized_pte: Path) -> None:
    side = _sidecar(quantized_pte)
    scheme = side["quantize"]["scheme"]
    assert side["quantize"]["linears"] == 2 * 7 + 1  # q k v o, three FFN, per layer; the output projection
    assert side["quantize"]["group_size"] == (32 if scheme in GROUPED else None)
    scan = side["pte_scan"]
    # int8 bytes (int4: two values a byte) plus scales (8da8w: and row sums) for every linear; the byte
    # embedding and norms stay.
    assert scan["weight_bytes"] < (0.3 if scheme in GROUPED else 0.45) * _unquantized_bytes()
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


def _model(dtype: torch.dtype) -> Transformer:
    args = ModelArgs(dim=96, n_layers=1, n_heads=6, n_kv_heads=2, vocab_size=64, multiple_of=32)
    return init_deterministic(Transformer(args), seed=4).eval().to(dtype)


def test_int4_weights_are_packed_two_per_byte_and_hold_torchaos_values() -> None:
    ours, theirs = _model(torch.float32), _model(torch.float32)
    quantize_model(ours, "int4", 32)
    quantize_model(theirs, "int4", 32, torchao_only=True)  # torchao's own tensors: the reference
    for name in ("attention.wq", "attention.wk", "feed_forward.w2"):
        a, b = ours.layers[0].get_submodule(name), theirs.layers[0].get_submodule(name)
        assert type(a).__name__ == "Int4GroupLinear" and a.packed.dtype == torch.uint8
        assert a.packed.numel() * 2 == b.weight.qdata.numel()  # half the bytes of torchao's one value a byte
        assert torch.equal(ql.unpack_int4(a.packed), b.weight.qdata)
        torch.testing.assert_close(ql.int4_weight(a.packed, a.scale, a.zero, torch.float32), b.weight.dequantize(),
                                   atol=0, rtol=0)
        x = torch.randn(2, 3, a.in_features, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(a(x), b(x), atol=1e-5, rtol=1e-5)
    assert weight_bytes(ours) < 0.7 * weight_bytes(theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scheme", ["8da4w", "8da8w"])
def test_dynamic_activation_linears_hold_torchaos_values_and_give_its_eager_results(scheme: str,
                                                                                   dtype: torch.dtype) -> None:
    ours, theirs = _model(dtype), _model(dtype)
    quantize_model(ours, scheme, 32)
    quantize_model(theirs, scheme, 32, torchao_only=True)  # torchao's own tensors: the reference
    four = scheme == "8da4w"
    for name in ("attention.wq", "attention.wk", "feed_forward.w2"):
        a, b = ours.layers[0].get_submodule(name), theirs.layers[0].get_submodule(name)
        assert type(a).__name__ == "DynamicLinear" and a.four_bit == four
        assert b.weight.activation_quantization is not None  # torchao quantizes the activations too
        unpack = ql.unpack_int4_tiles if four else ql.unpack_int8_tiles
        assert torch.equal(unpack(a.packed, a.out_features), b.weight.qdata)
        # int4: two values a byte (the last tile padded)
        assert a.packed.numel() * (2 if four else 1) >= b.weight.qdata.numel()
        x = torch.randn(2, 3, a.in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
        torch.testing.assert_close(a(x), b(x), atol=0, rtol=0)  # eager: torchao's own arithmetic
        # The CPU kernel's arithmetic (exact integer dots) is torchao's within its rounding.
        integer_rows = ql.int4_da8_integer_rows if four else ql.int8_da8_integer_rows
        got = integer_rows(x.reshape(-1, a.in_features), a.packed, a.scale, a.sums)
        want = b(x).reshape(-1, a.out_features).float()
        tol = 1e-5 if dtype == torch.float32 else 2 ** -6
        torch.testing.assert_close(got.float(), want, atol=tol * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("zero", [False, True], ids=["symmetric", "zero-point"])
def test_one_row_reductions_give_the_dequantized_products(dtype: torch.dtype, zero: bool) -> None:
    g = torch.Generator().manual_seed(2)
    n, k, group = 48, 96, 32
    x = torch.randn(1, k, generator=g).to(dtype)
    q4 = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g)
    s4 = (torch.rand(n, k // group, generator=g) + 0.5).to(dtype)
    z4 = torch.randint(-3, 4, (n, k // group), dtype=torch.int8, generator=g) if zero else None
    packed = ql.pack_int4(q4, group)
    w4 = (q4.float().reshape(n, -1, group) - (0 if z4 is None else z4.float().unsqueeze(-1))) * s4.float().unsqueeze(-1)
    want4 = x.float() @ w4.reshape(n, k).t()
    q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    s8 = (torch.rand(n, generator=g) / 64).to(dtype)
    want8 = x.float() @ (q8.float() * s8.float()[:, None]).t()
    # fp32 accumulation either way; bf16 rounds the result once.
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    for got, want in ((ql.int4_one_row(x, packed, s4, z4), want4), (ql.int8_one_row(x, q8, s8), want8)):
        assert got.dtype == dtype and got.shape == (1, n)
        torch.testing.assert_close(got.float(), want, atol=tol * float(want.abs().max()), rtol=0)
    # The wider forms (dequantize + mm; int8 GEMM in bf16) agree with them on the same row.
    torch.testing.assert_close(ql.int4_many_rows(x, packed, s4, z4).float(), want4,
                               atol=2 * tol * float(want4.abs().max()), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wider_forms_in_blocks_of_weight_rows_give_the_whole_weights_result(dtype: torch.dtype) -> None:
    """On CPU a wider step without our GEMM dequantizes ``block_rows`` weight rows at a time (a cache-sized
    transient, not the whole weight): the same values as the whole weight's, for a last block that is short."""
    g = torch.Generator().manual_seed(11)
    n, k = 200, 64
    x = torch.randn(5, k, generator=g).to(dtype)
    q8, s8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g), torch.rand(n, generator=g).to(dtype)
    packed = ql.pack_int4(torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g), 32)
    s4, z4 = torch.rand(n, 2, generator=g).to(dtype), torch.randint(-3, 4, (n, 2), dtype=torch.int8, generator=g)
    def same(got: torch.Tensor, want: torch.Tensor) -> None:
        # the same dequantized values; fp32's GEMM may sum another width's columns in another order
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * float(want.abs().max()) if dtype == torch.float32 else 0)

    for block in (64, 128):
        same(ql.int8_many_rows(x, q8, s8, block=block), ql.int8_many_rows(x, q8, s8))
        for zero in (None, z4):
            same(ql.int4_many_rows(x, packed, s4, zero, block=block), ql.int4_many_rows(x, packed, s4, zero))
    # a power of two of at least 64 rows, within the byte budget where the rows allow
    assert ql.block_rows(576, torch.bfloat16) == 2048 and ql.block_rows(576, torch.float32) == 1024
    assert ql.block_rows(1 << 20, torch.float32) == 64


class _TwoLinears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.register_buffer("q", torch.randint(-128, 128, (64, 96), dtype=torch.int8, generator=g))
        self.register_buffer("s", torch.rand(64, generator=g) / 64)
        self.register_buffer("p", ql.pack_int4(torch.randint(-8, 8, (32, 96), dtype=torch.int8, generator=g), 32))
        self.register_buffer("t", torch.rand(32, 3, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.offgraph_kv.int8_linear(x, self.q, self.s)
        return torch.ops.offgraph_kv.int4_linear(torch.cat([y, y[..., :32]], -1), self.p, self.t, None)


@pytest.mark.parametrize("reduce", [True, False], ids=["reduce", "mm"])
def test_quantized_ops_are_lowered_to_a_branch_on_the_rows_or_to_the_wide_form_alone(reduce: bool) -> None:
    model, width = _TwoLinears(), torch.export.Dim("t", max=64)
    ep = torch.export.export(model, (torch.randn(3, 96),), dynamic_shapes=({0: width},))
    program = ep.module()
    assert ql.lower_quantized_linears(program, reduce=reduce) == 2
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert not any("offgraph_kv" in str(t) for t in targets)  # nothing left for AOTInductor to call
    lowered = torch.export.export(program, (torch.randn(3, 96),), dynamic_shapes=({0: width},), strict=False)
    conds = [n for n in lowered.graph.nodes if n.target is torch.ops.higher_order.cond]
    assert len(conds) == (2 if reduce else 0)  # OFFGRAPH_KV_CPU_GEMV=mm: no reductions
    # The default mode ("auto") runs a quantized one-row step on our kernels (native/decode_linear.cpp).
    one_row = [getattr(lowered.graph_module, c.args[1].target) for c in conds]
    called = [{str(n.target) for n in g.graph.nodes if n.op == "call_function"} for g in one_row]
    assert [any("int8_linear_rows" in t for t in c) for c in called] == ([True, False] if reduce else [])
    assert [any("int4_linear_rows" in t for t in c) for c in called] == ([False, True] if reduce else [])
    for rows in (1, 5):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(lowered.module()(x), model(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bf16_dots", [True, False], ids=["bf16-dots", "no-bf16-dots"])
def test_quantized_bf16_linears_are_one_kernel_call_where_the_kernel_takes_every_width(
        monkeypatch: pytest.MonkeyPatch, bf16_dots: bool) -> None:
    """bf16 rows on a CPU with the bf16 dot product: our kernels take one row and many, so no branch."""
    from offgraph_kv.backend import decode_gemv

    monkeypatch.setenv(decode_gemv.ENV_SWITCH, "auto")
    monkeypatch.setattr(decode_gemv, "cpu_has_bf16_dots", lambda: bf16_dots)
    model, width = _TwoLinears().to(torch.bfloat16), torch.export.Dim("t", max=64)
    example = (torch.randn(3, 96).bfloat16(),)
    program = torch.export.export(model, example, dynamic_shapes=({0: width},)).module()
    assert ql.lower_quantized_linears(program, reduce=True, cpu=True) == 2
    lowered = torch.export.export(program, example, dynamic_shapes=({0: width},), strict=False)
    assert sum(n.target is torch.ops.higher_order.cond for n in lowered.graph.nodes) == (0 if bf16_dots else 2)
    for rows in (1, 5):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got, want = lowered.module()(x).float(), model(x).float()
        assert (got - want).abs().max() <= 2e-2 * want.abs().max()  # bf16 rounding of the int8 layer's output
