"""The two ways a prompt arrives on a channel: plain text on ``prompt``, or a JSON object on ``prompt_json``.

A plain prompt is always text, whatever it looks like (a robot may well ask about "{...}"), and its answer
takes the channel's ``output_format``. A prompt that needs more goes to ``prompt_json``: its own format,
``{"prompt": "Is the door open?", "output": {"choice": ["yes", "no"]}}`` (without ``"output"``: the channel's),
or a detection request, ``{"detect": "red cup, person"}`` (``"points": true`` for points instead of boxes),
whose prompt and format the node writes. No text is ever read two ways.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..engine.grounding import grounding_request, parse_labels
from ..engine.output_format import OutputFormat, format_from_json, parsed_json
from .image import PickedFrames
from .params import sampling_params
from .request_queue import PendingPrompt

KEYS = ("prompt", "output", "detect", "points")


@dataclass(frozen=True)
class PromptMessage:
    """What a message asks: ``text`` (a detection request: the labels as written), its own format, the
    labels to detect (a detection request) and whether as points."""

    text: str
    output: OutputFormat | None = None
    detect: tuple[str, ...] = ()
    points: bool = False


PromptReader = Callable[[str], PromptMessage]  # a message's data -> what it asks (ValueError: nothing usable)


def plain_prompt(data: str) -> PromptMessage:
    """A ``prompt`` message: its text, no format of its own."""
    return PromptMessage(data)


def json_prompt(data: str) -> PromptMessage:
    """A ``prompt_json`` message; ValueError says what is wrong with it."""
    message = parsed_json(data, "prompt_json message")
    unknown = sorted(set(message) - set(KEYS))
    if unknown:
        raise ValueError(f"prompt_json message has unknown keys {', '.join(unknown)} (known: {', '.join(KEYS)})")
    detect, prompt = message.get("detect"), message.get("prompt")
    if isinstance(detect, str) and prompt is None and "output" not in message:
        return PromptMessage(detect, detect=parse_labels(detect), points=message.get("points") is True)
    if not isinstance(prompt, str) or "detect" in message or "points" in message:
        raise ValueError('prompt_json message must hold a "prompt" string (with an optional "output") or a '
                         '"detect" string (with an optional "points")')  # fmt: skip
    return PromptMessage(prompt, format_from_json(message.get("output", {})))


def _detection(message: PromptMessage, values: Mapping[str, Any], frames: PickedFrames) -> tuple[str, OutputFormat]:
    """A detection request's prompt and format; ValueError for too many labels or no camera frame."""
    limit = int(values["detect_max_labels"])
    if len(message.detect) > limit:
        raise ValueError(f"a detection request names {len(message.detect)} labels; at most {limit} (detect_max_labels)")
    if not frames.images:
        topics = ", ".join(values["image_topics"])
        why = frames.note or f"no frame within image_max_age_s={float(values['image_max_age_s']):g} s"
        raise ValueError(f"a detection request needs a camera frame: none from {topics} ({why})")
    return grounding_request(message.detect, len(frames.images), message.points)


def pending_prompt(
    request_id: str, message: PromptMessage, values: Mapping[str, Any], frames: PickedFrames, channel: str
) -> PendingPrompt:
    """The prompt the worker answers, with the channel's ``values`` and the cameras' ``frames``: a detection
    request's grounding prompt and format, else the text with its format or the channel's; ValueError (a
    detection request without a frame)."""
    text, output = message.text, message.output or format_from_json(values["output_format"])
    if message.detect:
        text, output = _detection(message, values, frames)
    return PendingPrompt(
        request_id=request_id,
        text=text,
        sampling=sampling_params(values),
        system_prompt=str(values["system_prompt"]) or None,
        frames=frames,
        accepted_at=time.monotonic(),
        channel=channel,
        output=output,
        detect=message.detect,
    )
