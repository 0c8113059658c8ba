"""Interactive chat over one KV store: every turn continues the cached context.

Lines on stdin are user messages, except the commands

- ``/undo``: forget the last exchange (the store rewinds to before it);
- ``/regen``: answer the last message again (the store rewinds to where the answer began);
- ``/save FILE``: write the context (``FILE``, the store's rows) and the conversation (``FILE.json``);
- ``/quit``: stop.

``run.py --chat --resume FILE`` continues a saved conversation without feeding
it through the model again. Each turn feeds only what the cache does not hold
yet: the conversation is rendered with the chat template, and the cached ids
that are a prefix of it are kept (the store rewinds past any that are not).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from tokenizer import Tokenizer


class Conversation:
    """The messages, the token ids the store holds, and where each turn began."""

    def __init__(self, system: Optional[str]) -> None:
        self.messages: List[Dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.cached: List[int] = []  # exactly the store's committed positions
        self.turns: List[Dict[str, int]] = []  # per exchange: cached length before the user's message, after it

    def to_json(self) -> Dict[str, object]:
        return {"messages": self.messages, "cached": self.cached, "turns": self.turns}

    @classmethod
    def from_json(cls, data: Dict[str, object]) -> "Conversation":
        c = cls(None)
        c.messages, c.cached, c.turns = list(data["messages"]), list(data["cached"]), list(data["turns"])
        return c


def _rewind_to(store: object, conv: Conversation, length: int) -> None:
    """Back to `length` cached tokens; where a ring cannot go back that far,
    the context starts over (the next turn feeds the whole conversation)."""
    if length >= len(conv.cached):
        return
    try:
        store.rewind(len(conv.cached) - length)
        del conv.cached[length:]
    except ValueError:
        store.reset()
        conv.cached.clear()


def _answer(a: argparse.Namespace, method: object, store: object, tok: Tokenizer, conv: Conversation,
            stop_ids: List[int], max_write: int, seed: int) -> str:
    """Feed what the cache lacks of the conversation, then generate the answer."""
    from run import TextStream, generate, sample

    target = tok.chat_messages(conv.messages)
    common = 0
    while common < min(len(target), len(conv.cached)) and target[common] == conv.cached[common]:
        common += 1
    # At least the last token is fed again: its logits choose the answer's first token.
    common = min(common, len(target) - 1)
    _rewind_to(store, conv, common)
    common = len(conv.cached)
    start = common
    gen = torch.Generator().manual_seed(seed)
    stream = TextStream(tok, enabled=True)
    t0 = time.perf_counter()
    g = generate(method, store, target[common:], max_write, a.max_new_tokens, stop_ids,
                 pick=lambda logits: sample(logits, a.temperature, a.top_p, gen), on_token=stream.push)
    text = stream.finish()
    # What the store now holds past `start`: the fed prompt, then every generated
    # token but the one that ended generation (never fed).
    fed = target[common:] + g.generated_ids[:g.decode_steps]
    conv.cached += fed[: store.length - start]
    if g.message:
        print(f"note: {g.message}", file=sys.stderr)
    print(f"[{len(g.generated_ids)} tokens, {len(target) - common} fed, {len(conv.cached)} in the cache, "
          f"{time.perf_counter() - t0:.2f} s]", file=sys.stderr)
    return text


def interactive_chat(a: argparse.Namespace, sidecar: Dict[str, object], tok: Tokenizer,
                     tok_info: Dict[str, object]) -> int:
    import offgraph_kv.runtime as rt

    stop_ids = [] if a.ignore_stop else sorted(set(tok.stop_ids()) | set(tok_info.get("stop_ids") or []))
    rt.configure(initial_capacity=a.initial_capacity, max_capacity=a.max_capacity)
    try:
        method = rt.load_method(a.pte)
    finally:
        rt.configure()
    store = rt.stores()[-1]
    max_write = int(sidecar["max_write"])
    conv = Conversation(a.system)
    if a.resume:
        try:
            store.load(a.resume)
            conv = Conversation.from_json(json.loads(Path(a.resume + ".json").read_text()))
        except (ValueError, RuntimeError, OSError) as e:
            print(f"error: cannot resume from {a.resume}: {e}", file=sys.stderr)
            return 2
        if len(conv.cached) != store.length:
            print(f"error: {a.resume}.json describes {len(conv.cached)} cached tokens, the context holds "
                  f"{store.length}", file=sys.stderr)
            return 2
        print(f"[resumed {len(conv.turns)} exchanges, {store.length} tokens, no prefill]", file=sys.stderr)
    seed = a.seed
    for line in sys.stdin:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.strip() in ("/quit", "/exit"):
            break
        if line.strip() == "/undo":
            if not conv.turns:
                print("[nothing to undo]", file=sys.stderr)
                continue
            turn = conv.turns.pop()
            conv.messages = conv.messages[:-2]
            _rewind_to(store, conv, min(turn["before"], len(conv.cached)))
            print(f"[undone; {len(conv.cached)} tokens in the cache]", file=sys.stderr)
            continue
        if line.strip() == "/regen":
            if not conv.turns:
                print("[nothing to regenerate]", file=sys.stderr)
                continue
            conv.messages.pop()  # the answer; the user's message stays
            _rewind_to(store, conv, min(conv.turns[-1]["prompted"], len(conv.cached)))
            seed += 1  # a sampled answer comes out differently; a greedy one the same
            text = _answer(a, method, store, tok, conv, stop_ids, max_write, seed)
            conv.messages.append({"role": "assistant", "content": text})
            continue
        if line.startswith("/save "):
            path = line[len("/save "):].strip()
            store.save(path)
            Path(path + ".json").write_text(json.dumps(conv.to_json()))
            print(f"[saved {store.length} tokens to {path}]", file=sys.stderr)
            continue
        before = len(conv.cached)
        sys.stdout.write(f"> {line}\n")
        conv.messages.append({"role": "user", "content": line})
        prompted = len(tok.chat_messages(conv.messages))
        text = _answer(a, method, store, tok, conv, stop_ids, max_write, seed)
        conv.turns.append({"before": before, "prompted": prompted})
        conv.messages.append({"role": "assistant", "content": text})
    return 0
