"""Reading the JSON files of a checkpoint directory, with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import ProcessingError


def read_json_object(file: Path, error: type[ProcessingError] = ProcessingError) -> dict[str, Any] | None:
    """The JSON object in ``file``; None when the file does not exist; ``error`` when unreadable or not an object."""
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"cannot read {file}: {exc}") from exc
    if not isinstance(data, dict):
        raise error(f"{file} must hold a JSON object")
    return data
