"""What crosses the network for one prompt: the conversation as OpenAI chat messages (camera frames as JPEG
or PNG data URLs) and the request body (sampling settings, the answer's format in vLLM's fields).

The node keeps the conversation and sends all of it each turn; the server's prefix cache reuses what it has
seen. Frames are encoded once per turn and kept as their data URL for the turns that follow.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import cv2
import numpy as np

from ..engine.events import Request, SamplingParams, Turn
from ..engine.output_format import OutputFormat

JPEG_QUALITY = 90
IMAGE_FORMATS = ("jpeg", "png")


def data_url(image: np.ndarray, color: str, image_format: str) -> str:
    """An HWC uint8 frame (``color`` "rgb" or "bgr") as a ``data:image/...;base64,`` URL."""
    bgr = image if color == "bgr" else cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_RGB2BGR)
    params = [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY] if image_format == "jpeg" else []
    ok, encoded = cv2.imencode(f".{'jpg' if image_format == 'jpeg' else 'png'}", bgr, params)
    if not ok:
        raise ValueError(f"could not encode a {image.shape} frame as {image_format}")
    return f"data:image/{image_format};base64,{base64.b64encode(encoded.tobytes()).decode()}"


def user_message(turn: Turn, image_format: str) -> dict[str, Any]:
    """One user turn: its frames first (in order), then its text, as the local template places them.
    ValueError for a turn with videos: they are not sent to a server (never dropped silently)."""
    if turn.videos:
        raise ValueError("backend openai does not send videos; ask with images, or use backend local for video")
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": data_url(image, turn.color, image_format)}} for image in turn.images
    ]
    if turn.text:
        content.append({"type": "text", "text": turn.text})
    return {"role": "user", "content": content}


@dataclass
class Conversation:
    """A session's messages so far (system prompt first, then user and assistant turns) and the tokens the
    server counted for them (its usage of the last turn: prompt plus answer)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0

    def with_turn(self, system_prompt: str | None, user: dict[str, Any]) -> list[dict[str, Any]]:
        """The messages of the next request: the history (a new conversation starts with ``system_prompt``)
        and ``user``."""
        head = [{"role": "system", "content": system_prompt}] if system_prompt and not self.messages else []
        return [*head, *self.messages, user]

    def keep(self, sent: Sequence[dict[str, Any]], answer: str, tokens: int) -> None:
        """Remember a finished turn: what was sent, the answer and the tokens they take."""
        self.messages = [*sent, {"role": "assistant", "content": answer}]
        self.tokens = tokens


def format_fields(fmt: OutputFormat | None) -> dict[str, Any]:
    """The answer's format as vLLM takes it: a JSON schema as OpenAI's ``response_format``, a regular
    expression or choices as ``structured_outputs``."""
    if fmt is None:
        return {}
    if fmt.kind == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": fmt.spec}}}
    return {"structured_outputs": {fmt.kind: fmt.spec}}


def sampling_fields(sampling: SamplingParams, defaults: SamplingParams) -> dict[str, Any]:
    """The request's sampling settings (each falling back to the node's default, then to the server's)."""

    def pick(name: str) -> Any:
        value = getattr(sampling, name)
        return getattr(defaults, name) if value is None else value

    fields = {
        "temperature": pick("temperature"),
        "top_p": pick("top_p"),
        "top_k": pick("top_k"),
        "min_p": pick("min_p"),
        "repetition_penalty": pick("repetition_penalty"),
        "presence_penalty": pick("presence_penalty"),
        "seed": pick("seed"),
        "max_tokens": pick("max_new_tokens"),
        "ignore_eos": pick("ignore_eos"),
    }
    if fields["top_k"] == 0:
        fields["top_k"] = -1  # vLLM's "off"
    body = {k: v for k, v in fields.items() if v is not None}
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    return body


def request_body(
    model: str, request: Request, messages: list[dict[str, Any]], defaults: SamplingParams
) -> dict[str, Any]:
    """The chat-completions body of ``request``: streamed, with usage in the last chunk, token log-probabilities
    when the request wants its tokens' probabilities."""
    body = {
        "model": model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        **sampling_fields(request.sampling, defaults),
        **format_fields(request.output),
    }
    if request.token_probs:
        body["logprobs"] = True
    return body
