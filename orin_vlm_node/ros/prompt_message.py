"""The two ways a prompt arrives on a channel: plain text on ``prompt``, or a JSON object on ``prompt_json``.

A plain prompt is always text, whatever it looks like (a robot may well ask about "{...}"), and its answer
takes the channel's ``output_format``. A prompt that needs more goes to ``prompt_json``: its own format,
``{"prompt": "Is the door open?", "output": {"choice": ["yes", "no"]}}`` (without ``"output"``: the channel's),
or a detection request, ``{"detect": "red cup, person"}`` (``"points": true`` for points instead of boxes),
whose prompt and format the node writes. A prompt about time asks for the cameras' recent past as video,
``{"prompt": "Which way did the cart go?", "video": {"seconds": 4, "fps": 2}}`` (``"video": 4``: the channel's
rate), as a channel does for every prompt with ``video_seconds``. No text is ever read two ways.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..engine.grounding import grounding_request, parse_labels
from ..engine.output_format import OutputFormat, format_from_json, parsed_json
from .frame_history import FrameHistory, PickedVideos
from .image import PickedFrames
from .params import sampling_params
from .request_queue import PendingPrompt

KEYS = ("prompt", "output", "detect", "points", "video")
VIDEO_LIMITS = {"seconds": (0.0, 600.0), "fps": (0.0, 30.0)}  # exclusive lower, inclusive upper bounds


@dataclass(frozen=True)
class PromptMessage:
    """What a message asks: ``text`` (a detection request: the labels as written), its own format, the
    labels to detect (a detection request) and whether as points."""

    text: str
    output: OutputFormat | None = None
    detect: tuple[str, ...] = ()
    points: bool = False
    video: dict[str, float] | None = None  # its own video request: "seconds", and "fps" if given


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
    if isinstance(detect, str) and prompt is None and "output" not in message and "video" not in message:
        return PromptMessage(detect, detect=parse_labels(detect), points=message.get("points") is True)
    if not isinstance(prompt, str) or "detect" in message or "points" in message:
        raise ValueError('prompt_json message must hold a "prompt" string (with optional "output" and "video") '
                         'or a "detect" string (with an optional "points"; detections are found in frames, '
                         'not in video)')  # fmt: skip
    video = video_request(message["video"]) if "video" in message else None
    return PromptMessage(prompt, format_from_json(message.get("output", {})), video=video)


def video_request(value: Any) -> dict[str, float]:
    """A prompt's ``"video"``: seconds, or ``{"seconds": s, "fps": r}``; ValueError naming what is wrong."""
    request = {"seconds": value} if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if not isinstance(request, dict) or "seconds" not in request or set(request) - set(VIDEO_LIMITS):
        raise ValueError('"video" must be seconds or {"seconds": s, "fps": r}')
    for key, number in request.items():
        low, high = VIDEO_LIMITS[key]
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not low < number <= high:
            raise ValueError(f'"video" {key} must be a number above {low:g} and at most {high:g}, got {number!r}')
    return {k: float(v) for k, v in request.items()}


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


def _videos(message: PromptMessage, values: Mapping[str, Any], history: FrameHistory) -> PickedVideos:
    """The cameras' recent past when the prompt (or its channel, ``video_seconds``) asks for it, else none."""
    asked = {"seconds": float(values["video_seconds"]), "fps": float(values["video_fps"]), **(message.video or {})}
    if message.detect or asked["seconds"] <= 0:
        return PickedVideos()
    topics = list(values["image_topics"])
    return history.pick(topics, asked["seconds"], asked["fps"], float(values["image_max_age_s"]))


def pending_prompt(
    request_id: str,
    message: PromptMessage,
    values: Mapping[str, Any],
    frames: PickedFrames,
    channel: str,
    history: FrameHistory,
) -> PendingPrompt:
    """The prompt the worker answers, with the channel's ``values`` and the cameras' ``frames``: a detection
    request's grounding prompt and format, else the text with its format or the channel's, and the cameras'
    last seconds from ``history`` instead of their frames when video is asked; ValueError (a detection request
    without a frame, a video prompt without history)."""
    text, output = message.text, message.output or format_from_json(values["output_format"])
    if message.detect:
        text, output = _detection(message, values, frames)
    videos = _videos(message, values, history)
    if videos.videos:
        frames = PickedFrames()  # the videos end with the latest frames: they are not sent twice
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
        videos=videos,
    )
