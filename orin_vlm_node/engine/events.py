"""What a request asks for and what the engine streams back.

These types are the engine's public surface: the CLI, the ROS node and the benchmarks consume them,
so they carry plain Python values only (no tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from ..processing.video import Video
from .output_format import OutputFormat

FinishReason = Literal["stop", "length", "cancelled", "kv_pool_exhausted", "error"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request. ``None`` fields take the checkpoint's generation_config."""

    temperature: float | None = None  # 0 = greedy
    top_k: int | None = None  # 0 = off
    top_p: float | None = None  # 1.0 = off
    min_p: float | None = None  # 0.0 = off
    repetition_penalty: float | None = None  # 1.0 = off
    presence_penalty: float | None = None  # 0.0 = off
    seed: int | None = None
    max_new_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool | None = None  # True: an EOS token does not end the answer (benchmarks: fixed lengths)


@dataclass(frozen=True)
class Turn:
    """One user turn: text plus the images it shows (numpy HWC uint8 RGB), in placeholder order, and the
    videos (frames with their times), placed after the images.

    ``color`` (extension) names the channel order of ``images`` and video frames ("rgb" or "bgr"), so BGR
    frames from OpenCV or cv_bridge need no conversion copy before preprocessing.
    """

    text: str
    images: tuple[np.ndarray, ...] = ()
    color: str = "rgb"
    videos: tuple[Video, ...] = ()


@dataclass
class Request:
    """One generation request. With ``session_id`` set, earlier turns of that session stay cached
    and only this turn's new tokens are prefilled."""

    turn: Turn
    sampling: SamplingParams = field(default_factory=SamplingParams)
    system_prompt: str | None = None
    session_id: str | None = None
    request_id: str | None = None
    output: OutputFormat | None = None  # the format the answer must match (None: free text)
    token_probs: bool = False  # report the model's probability of each token it chose (Finished.token_probs)


@dataclass(frozen=True)
class TextDelta:
    """Streamed text: never splits a UTF-8 character; all deltas concatenate to the final text."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Finished:
    """The last event of every request, whatever happened."""

    request_id: str
    finish_reason: FinishReason
    text: str
    token_ids: tuple[int, ...]
    metrics: dict[str, float]
    error: str | None = None
    # With an output format: {"format": ..., "complete": bool, "value": the parsed JSON or the text (None if
    # incomplete)}; None for free text.
    output: dict | None = None
    # With Request.token_probs: each generated token's probability under the model's own distribution (the
    # softmax of its logits, before any format mask, penalty or temperature), in token order.
    token_probs: tuple[float, ...] | None = None
    # With token_probs: the (start, end) characters of ``text`` each of those tokens wrote (a detection's
    # score is read from the tokens of its object).
    token_spans: tuple[tuple[int, int], ...] | None = None


Event = TextDelta | Finished
