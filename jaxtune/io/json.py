"""JSON files as dicts, with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path

from jaxtune.errors import JaxtuneError


def read_json(path: Path) -> dict:
    """A JSON file as a dict, with errors that name the file."""
    if not path.is_file():
        raise JaxtuneError(f"{path}: file not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise JaxtuneError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
