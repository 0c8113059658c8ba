"""Tokenizers for the example: pytorch_tokenizers for real models, bytes for the toy one.

``load_tokenizer(None)`` gives a byte-level vocabulary (ids 0-255 are bytes, then
BOS and EOS), so the default deterministic model runs with nothing downloaded.
A path picks the kind by content: ``tokenizer.json`` -> Hugging Face tokenizers,
``tokenizer.model`` -> SentencePiece, falling back to tiktoken (Llama 3).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from json_files import json_field, read_json_object

BYTE_VOCAB = 256
BYTE_BOS = 256
BYTE_EOS = 257
BYTE_VOCAB_SIZE = 258

# Llama 3 chat stop tokens besides <|end_of_text|>.
_LLAMA3_EXTRA_STOPS = ("<|eot_id|>", "<|eom_id|>")


class Tokenizer(ABC):
    """The small surface run.py needs, the same for every backing implementation."""

    kind: str = "?"
    path: Optional[str] = None
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    vocab_size: int = 0

    @abstractmethod
    def encode(self, text: str, bos: bool = True) -> List[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    def stop_ids(self) -> List[int]:
        return [] if self.eos_id is None else [self.eos_id]

    def chat_prompt(self, user: str, system: Optional[str] = None) -> List[int]:
        """Token ids of a single-turn chat prompt, ending where the assistant speaks."""
        return self.chat_messages(([{"role": "system", "content": system}] if system else [])
                                  + [{"role": "user", "content": user}])

    def chat_messages(self, messages: Sequence[Dict[str, str]]) -> List[int]:
        """Token ids of a whole conversation (role/content dicts), ending where the
        assistant speaks next. Llama 2 style: the fallback without a template."""
        ids: List[int] = []
        system = ""
        for m in messages:
            if m["role"] == "system":
                system = f"<<SYS>>\n{m['content']}\n<</SYS>>\n\n"
            elif m["role"] == "user":
                ids += self.encode(f"[INST] {system}{m['content'].strip()} [/INST]", bos=True)
                system = ""
            else:
                ids += self.encode(f" {m['content'].strip()} ", bos=False) + ([self.eos_id] if self.eos_id is not None else [])
        return ids

    def describe(self) -> Dict[str, object]:
        return {"kind": self.kind, "path": self.path, "bos_id": self.bos_id, "eos_id": self.eos_id,
                "vocab_size": self.vocab_size, "stop_ids": self.stop_ids()}


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens; 256 = BOS, 257 = EOS."""

    kind = "bytes"
    bos_id = BYTE_BOS
    eos_id = BYTE_EOS
    vocab_size = BYTE_VOCAB_SIZE

    def encode(self, text: str, bos: bool = True) -> List[int]:
        return ([BYTE_BOS] if bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # Specials and out-of-range ids (a model with a larger vocab) print nothing.
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """``tokenizer.json`` through pytorch_tokenizers' HuggingFaceTokenizer."""

    kind = "hf"

    def __init__(self, path: Path) -> None:
        from pytorch_tokenizers import HuggingFaceTokenizer

        self.path = str(path)
        # Its own config parsing assumes string bos/eos entries; read the config here instead.
        try:
            self._impl = HuggingFaceTokenizer(str(path), None)
        except Exception as e:  # the tokenizers library raises a bare Exception for a broken file
            raise ValueError(f"tokenizer {path} is not a readable tokenizer.json: {e}") from e
        self._model = self._impl.model
        self.vocab_size = self._model.get_vocab_size()
        config_path = path.parent / "tokenizer_config.json"
        config = read_json_object(config_path) if config_path.is_file() else {}
        where = str(config_path)
        self.chat_template: Optional[str] = _chat_template(config, where)
        template_file = path.parent / "chat_template.jinja"  # where transformers 5 saves it
        if self.chat_template is None and template_file.is_file():
            self.chat_template = template_file.read_text()
            where = str(template_file)
        if self.chat_template is not None:
            _compile_template(self.chat_template, where)  # a broken template is named now, not at the first chat
        # Some models (SmolLM2) never prepend BOS to plain text.
        self.add_bos = json_field(config, "add_bos_token", "bool", str(config_path), True)
        # Ids the checkpoint ends a turn with besides EOS (a GGUF's EOT/EOM).
        stops = json_field(config, "stop_token_ids", "int_or_ints", str(config_path), [])
        self._config_stops = stops if isinstance(stops, list) else [stops]
        for i in self._config_stops:
            if not 0 <= i < self.vocab_size:  # a stop id no step can produce would never stop anything
                raise ValueError(f"{config_path}: 'stop_token_ids' holds {i}, outside the vocabulary of "
                                 f"{self.vocab_size} tokens of {path.name}")
        self._bos_text = self._special_text(config, "bos_token", str(config_path))
        self._eos_text = self._special_text(config, "eos_token", str(config_path))
        self.bos_id = self._special_id(self._bos_text, "bos_token", str(config_path)) if "bos_token" in config \
            else self._impl.bos_id
        self.eos_id = self._special_id(self._eos_text, "eos_token", str(config_path)) if "eos_token" in config \
            else self._impl.eos_id
        self._extra_stops = [i for i in (self._model.token_to_id(t) for t in _LLAMA3_EXTRA_STOPS) if i is not None]

    @staticmethod
    def _special_text(config: Dict[str, object], key: str, where: str) -> str:
        """A special token's text: a string, an AddedToken object (older configs) or null ("")."""
        token = config.get(key)
        if isinstance(token, dict):  # older configs store AddedToken dicts
            token = json_field(token, "content", "str", f"{where} {key}")
        elif token is not None and not isinstance(token, str):
            # str(5) would be looked up as the token "5": another token, silently.
            raise ValueError(f"{where}: {key!r} must be a string or an object with 'content', got {token!r}")
        return token or ""

    def _special_id(self, text: str, key: str, where: str) -> Optional[int]:
        """The id of a special token the config names; one the vocabulary lacks is named (read as
        no token, EOS would never end generation)."""
        if not text:
            return None
        found = self._model.token_to_id(text)
        if found is None:
            raise ValueError(f"{where}: {key} {text!r} is not a token of {Path(str(self.path)).name}")
        return found

    def encode(self, text: str, bos: bool = True) -> List[int]:
        # add_special_tokens=False: BOS is added here, once, whatever the post-processor does.
        ids = self._model.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos and self.add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._model.decode(list(ids), skip_special_tokens=True)

    def stop_ids(self) -> List[int]:
        return sorted(set(super().stop_ids()) | set(self._extra_stops) | set(self._config_stops))

    def chat_messages(self, messages: Sequence[Dict[str, str]]) -> List[int]:
        if not self.chat_template:
            return super().chat_messages(messages)
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = lambda msg: (_ for _ in ()).throw(ValueError(msg))
        text = env.from_string(self.chat_template).render(
            messages=list(messages), add_generation_prompt=True, bos_token=self._bos_text, eos_token=self._eos_text
        )
        # The template writes BOS itself; the specials in it are real specials.
        return self._model.encode(text, add_special_tokens=False).ids


class _PytorchTokenizersModel(Tokenizer):
    """A ``tokenizer.model`` read by one of pytorch_tokenizers' classes."""

    def __init__(self, path: Path, impl: object) -> None:
        self.path = str(path)
        self._impl = impl
        self.vocab_size = impl.n_words
        self.bos_id = impl.bos_id
        self.eos_id = impl.eos_id

    def encode(self, text: str, bos: bool = True) -> List[int]:
        return self._impl.encode(text, bos=bos, eos=False)


class SentencePieceTokenizer(_PytorchTokenizersModel):
    """SentencePiece ``tokenizer.model`` (Llama 2) through pytorch_tokenizers."""

    kind = "sentencepiece"

    def __init__(self, path: Path) -> None:
        from pytorch_tokenizers import Llama2cTokenizer

        super().__init__(path, Llama2cTokenizer(model_path=str(path)))

    def decode(self, ids: Sequence[int]) -> str:
        return self._impl.decode(list(ids))


class TiktokenLlama3Tokenizer(_PytorchTokenizersModel):
    """Llama 3 tiktoken ``tokenizer.model`` through pytorch_tokenizers."""

    kind = "tiktoken"

    def __init__(self, path: Path) -> None:
        from pytorch_tokenizers import TiktokenTokenizer

        super().__init__(path, TiktokenTokenizer(model_path=str(path)))

    def decode(self, ids: Sequence[int]) -> str:
        specials = set(self._impl.special_tokens.values())
        return self._impl.decode([i for i in ids if i not in specials])

    def stop_ids(self) -> List[int]:
        extra = [self._impl.special_tokens[t] for t in _LLAMA3_EXTRA_STOPS if t in self._impl.special_tokens]
        return sorted(set(super().stop_ids()) | set(extra))

    def chat_messages(self, messages: Sequence[Dict[str, str]]) -> List[int]:
        def header(role: str) -> str:
            return f"<|start_header_id|>{role}<|end_header_id|>\n\n"

        text = "<|begin_of_text|>"
        for m in messages:
            text += header(m["role"]) + m["content"] + "<|eot_id|>"
        text += header("assistant")
        return self._impl.encode(text, bos=False, eos=False, allowed_special="all")


def _chat_template(config: Dict[str, object], where: str) -> Optional[str]:
    """tokenizer_config.json's chat template: a string, or transformers' list of named templates
    (the one named "default" is what transformers applies without a name)."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
        if template is None:
            raise ValueError(f"{where}: 'chat_template' lists templates but none named 'default' "
                             f"(names: {sorted(map(str, named))})")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{where}: 'chat_template' must be a string, got {type(template).__name__}")
    return template


def _compile_template(template: str, where: str) -> None:
    import jinja2

    try:
        jinja2.Environment(trim_blocks=True, lstrip_blocks=True).parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{where}: the chat template is not valid Jinja (line {e.lineno}: {e.message})") from None


def load_tokenizer(path: "str | Path | None") -> Tokenizer:
    """A tokenizer for ``path`` (file or directory holding one); None = byte-level."""
    if path is None or str(path) in ("", "bytes"):
        return ByteTokenizer()
    p = Path(path)
    if p.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (p / name).is_file():
                return load_tokenizer(p / name)
        raise FileNotFoundError(f"{p} holds neither tokenizer.json nor tokenizer.model")
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer {p} does not exist")
    if p.suffix == ".json":
        return HFTokenizer(p)
    # A .model file is SentencePiece protobuf (Llama 2) or tiktoken BPE text (Llama 3).
    try:
        return SentencePieceTokenizer(p)
    except Exception:
        pass
    try:
        return TiktokenLlama3Tokenizer(p)
    except Exception as e:
        raise ValueError(f"{p} is neither a SentencePiece nor a tiktoken tokenizer model: {e}") from e


def find_tokenizer_near(directory: "str | Path") -> Optional[Path]:
    """The tokenizer file that ships next to a checkpoint, if any."""
    d = Path(directory)
    d = d if d.is_dir() else d.parent
    for name in ("tokenizer.json", "tokenizer.model"):
        if (d / name).is_file():
            return (d / name).resolve()
    return None
