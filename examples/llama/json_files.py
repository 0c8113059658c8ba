"""JSON files the example reads (configs, sidecars): one object, or a ValueError naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Union


def read_json_object(path: Union[str, Path]) -> Dict[str, object]:
    """A JSON object from ``path``; a ValueError naming the file otherwise."""
    path = Path(path)
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value
