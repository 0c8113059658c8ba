"""The example's interactive chat through piped stdin: each turn continues the
cached context; /undo, /regen, /save and --resume use rewind and saved contexts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from test_llama_example import toy_pte  # noqa: F401  (the shared toy export)

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "examples" / "llama" / "run.py"


def chat(pte: Path, stdin: str, *extra: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(RUN), str(pte), "--chat", "--max-new-tokens", "12", "--ignore-stop",
                           *extra], input=stdin, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_undo_then_the_same_message_gives_the_same_answer(toy_pte: Path) -> None:  # noqa: F811
    once = chat(toy_pte, "hello\n").stdout
    out = chat(toy_pte, "hello\n/undo\nhello\n")
    assert once.startswith("> hello\n") and len(once) > len("> hello\n") + 1
    assert out.stdout == once + once
    assert "[undone; 0 tokens in the cache]" in out.stderr


def test_regen_of_a_greedy_answer_gives_it_again_feeding_one_token(toy_pte: Path) -> None:  # noqa: F811
    base = chat(toy_pte, "hello\nworld\n").stdout
    out = chat(toy_pte, "hello\nworld\n/regen\n")
    second = base.split("> world\n", 1)[1]
    assert out.stdout == base + second
    # The regenerated turn fed one token (the last of the prompt), not the conversation.
    assert out.stderr.strip().splitlines()[-1].startswith("[12 tokens, 1 fed,")


def test_a_saved_conversation_resumes_in_a_new_process_with_the_same_next_answer(toy_pte: Path,  # noqa: F811
                                                                                   tmp_path: Path) -> None:
    saved = tmp_path / "chat.ogkv"
    whole = chat(toy_pte, f"hello\n/save {saved}\nworld\n")
    resumed = chat(toy_pte, "world\n", "--resume", str(saved))
    assert resumed.stdout.startswith("> world\n") and whole.stdout.endswith(resumed.stdout)
    assert "resumed 1 exchanges" in resumed.stderr and "no prefill" in resumed.stderr


def test_resume_from_a_damaged_file_is_refused(toy_pte: Path, tmp_path: Path) -> None:  # noqa: F811
    saved = tmp_path / "chat.ogkv"
    chat(toy_pte, f"hello\n/save {saved}\n")
    saved.write_bytes(saved.read_bytes()[:-10])
    done = subprocess.run([sys.executable, str(RUN), str(toy_pte), "--chat", "--resume", str(saved)], input="",
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "truncated or corrupt" in done.stderr
