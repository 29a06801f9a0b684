"""The two ways a prompt arrives on a channel: plain text on ``prompt``, or a JSON object on ``prompt_json``.

A plain prompt is always text, whatever it looks like (a robot may well ask about "{...}"), and its answer
takes the channel's ``output_format``. A prompt that needs its own format goes to ``prompt_json``:
``{"prompt": "Is the door open?", "output": {"choice": ["yes", "no"]}}``; without ``"output"`` it takes the
channel's format too. No text is ever read two ways.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..engine.output_format import OutputFormat, format_from_json

KEYS = ("prompt", "output")
PromptReader = Callable[[str], tuple[str, "OutputFormat | None"]]  # a message's text -> (prompt, its format)


def plain_prompt(data: str) -> tuple[str, OutputFormat | None]:
    """A ``prompt`` message: its text, no format of its own."""
    return data, None


def json_prompt(data: str) -> tuple[str, OutputFormat | None]:
    """A ``prompt_json`` message: its text and its own format (None: the channel's); ValueError says what is
    wrong with it."""
    try:
        message: Any = json.loads(data)
    except json.JSONDecodeError as exc:
        raise ValueError(f"prompt_json message is not JSON: {exc}") from exc
    if not isinstance(message, dict) or not isinstance(message.get("prompt"), str):
        raise ValueError('prompt_json message must be a JSON object with a "prompt" string')
    unknown = sorted(set(message) - set(KEYS))
    if unknown:
        raise ValueError(f"prompt_json message has unknown keys {', '.join(unknown)} (known: {', '.join(KEYS)})")
    return message["prompt"], format_from_json(message.get("output", {}))
