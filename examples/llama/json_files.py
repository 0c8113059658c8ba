"""JSON files the example reads (configs, sidecars): one object, or a ValueError naming the file;
their fields read through one typed reader (``json_field``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Mapping, Union


# The largest JSON file the example reads whole (configs, indexes, tokenizer configs of a few MB):
# a damaged or hostile "config.json" of gigabytes is named, not read into memory.
MAX_JSON_BYTES = 64 << 20


def _no_duplicate_keys(pairs: "list[tuple[str, object]]") -> Dict[str, object]:
    # json keeps the last of duplicated keys silently: two hidden_size values are a damaged file.
    out: Dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice in one object")
        out[key] = value
    return out


def read_json_object(path: Union[str, Path]) -> Dict[str, object]:
    """A JSON object from ``path``; a ValueError naming the file otherwise."""
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{path} is {size} bytes, more than the {MAX_JSON_BYTES} a JSON config may take")
    try:
        value = json.loads(path.read_text(), object_pairs_hook=_no_duplicate_keys)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    except RecursionError:  # deeply nested arrays exhaust the decoder's recursion
        raise ValueError(f"{path} is not valid JSON: it nests deeper than Python's decoder follows") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


# What each kind of field may hold, in JSON's own types; a whole-number float (8192.0, as Python
# writes float arithmetic) counts as an integer, a fraction, a bool or a string does not.
_KIND_WORDS = {
    "int": "an integer",
    "number": "a number",
    "bool": "true or false",
    "str": "a string",
    "object": "a JSON object",
    "strs": "a list of strings",
    "int_or_ints": "an integer or a list of integers",
}
REQUIRED = object()  # json_field's default: the field must be present


def _is_int(value: object) -> bool:
    # bool is an int subclass in Python: true where an integer belongs is a damaged config, not 1.
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def json_field(obj: Mapping[str, object], key: str, kind: str, where: str, default: object = REQUIRED) -> Any:
    """``obj[key]`` checked to be ``kind`` (a key of ``_KIND_WORDS``) and returned as Python's type of
    it; absent or null takes ``default`` (a ValueError when there is none). The error names ``where``
    (the file), the key, the expected kind and the value found: the one typed reader of config fields,
    so that "false" is never read as true nor 576.5 as 576."""
    value = obj.get(key)
    if value is None:
        if default is REQUIRED:
            raise ValueError(f"{where} has no {key!r}")
        return default
    ok = {
        "int": _is_int(value),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "object": isinstance(value, dict),
        "strs": isinstance(value, list) and all(isinstance(v, str) for v in value),
        "int_or_ints": _is_int(value) or (isinstance(value, list) and all(_is_int(v) for v in value)),
    }[kind]
    if not ok:
        shown = repr(value)
        raise ValueError(f"{where}: {key!r} must be {_KIND_WORDS[kind]}, got "
                         f"{shown if len(shown) <= 80 else shown[:77] + '...'} ({type(value).__name__})")
    if kind == "int":
        return int(value)  # type: ignore[arg-type]
    if kind == "number":
        return float(value)  # type: ignore[arg-type]
    if kind == "int_or_ints":
        return [int(v) for v in value] if isinstance(value, list) else int(value)  # type: ignore[union-attr, arg-type]
    return value
