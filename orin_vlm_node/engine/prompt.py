"""From a request to what the model computes: the new token ids of a turn, their RoPE positions and images.

A first turn renders the whole conversation (system prompt, the user turn with its images); a session's
later turn renders only what follows the cached tokens (:class:`ConversationRenderer`), preceded by the
session's pending ids. Images are preprocessed once here; their content hashes key the image-pad tokens
for the prefix cache (:mod:`.images`). RoPE positions continue the session's (dual position tracking:
KV slots count tokens, RoPE positions run behind them after an image).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import torch

from ..model.config import ModelConfig
from ..model.positions import mrope_positions
from ..processing import ChatTemplate, ImageBatch, ImageProcessor, Tokenizer
from ..processing.video import VideoLayout, VideoProcessor
from .conversation import ConversationRenderer
from .events import Turn
from .images import image_keys, token_extra_keys
from .session import Session


class ConversationFull(ValueError):
    """A continuing conversation has no room left for the next turn: ``history`` tokens of earlier turns
    and the turn's own ``new`` would pass ``limit``."""

    def __init__(self, history: int, new: int, limit: int) -> None:
        super().__init__(
            f"prompt is too long: {history + new} tokens ({history} from earlier turns), max_context_tokens is {limit}"
        )
        self.history = history


@dataclass
class PreparedTurn:
    """What one turn adds to its sequence."""

    new_ids: list[int]  # tokens to prefill: the session's pending ids, then the turn's own
    extra_keys: list[Hashable | None]  # per new token: the image hash of an image pad, else None
    messages: list[dict]  # the conversation after this turn, in chat-template form
    positions: torch.Tensor  # (3, len(new_ids)) RoPE positions
    next_position: int  # RoPE position after the turn
    images: ImageBatch | None  # the turn's images, then its videos' frame groups (one entry each), in prompt order
    history: int  # tokens the session's KV already holds
    text_before: int = 0  # the first new ids are the previous answer's (text, even an image-pad id)
    videos: tuple[VideoLayout, ...] = ()  # how each video was sent (frames, timestamps, tokens)

    @property
    def total_tokens(self) -> int:
        return self.history + len(self.new_ids)


class TurnPreparer:
    """Renders, tokenizes and positions one turn with the checkpoint's tokenizer, template and image settings."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        image_processor: ImageProcessor,
        video_processor: VideoProcessor,
        model: ModelConfig,
        video_max_tokens: int = 0,
    ):
        self.renderer = ConversationRenderer(tokenizer, template)
        self.image_processor = image_processor
        self.video_processor = video_processor
        self.video_max_tokens = video_max_tokens  # each video's visual tokens at most (0: unbounded)
        self.visual_pads = model.visual_token_ids
        self.model = model

    def shortest_prompt(self, system_prompt: str | None, prompt_special_tokens: bool = False) -> int:
        """Tokens of a first turn with no question text and no image (the floor of every prompt)."""
        ids, _ = self.renderer.first_turn(system_prompt, Turn(text=""), [], prompt_special_tokens)
        return len(ids)

    def prepare(
        self,
        turn: Turn,
        system_prompt: str | None,
        session: Session | None,
        limit: int,
        prompt_special_tokens: bool = False,
    ) -> PreparedTurn:
        """ValueError (a ProcessingError among them) for a bad turn or one past ``limit`` tokens in all
        (:class:`ConversationFull` when the session's earlier turns take part of that).
        Message text is plain text unless ``prompt_special_tokens`` (``processing.prompt``)."""
        check_turn(turn)
        batch = self.image_processor.preprocess(list(turn.images), color=turn.color) if turn.images else None
        counts = list(batch.num_tokens) if batch is not None else []
        videos = None
        if turn.videos:
            videos = self.video_processor.preprocess(turn.videos, turn.color, self.video_max_tokens)
        layouts = tuple(videos.layouts) if videos is not None else ()
        if session is not None:
            delta, messages = self.renderer.next_turn(
                session.messages, session.answer, turn, counts, prompt_special_tokens, layouts
            )
            new_ids, history, start = session.pending_ids + delta, len(session.token_ids), session.next_position
            text_before = len(session.pending_ids)
        else:
            new_ids, messages = self.renderer.first_turn(system_prompt, turn, counts, prompt_special_tokens, layouts)
            history, start, text_before = 0, 0, 0
        if videos is not None:
            batch = videos.groups if batch is None else join_batches(batch, videos.groups)
            counts = list(batch.num_tokens)
        if history + len(new_ids) > limit:
            if history:
                raise ConversationFull(history, len(new_ids), limit)
            raise ValueError(f"prompt is too long: {len(new_ids)} tokens, max_context_tokens is {limit}")
        positions, next_position = mrope_positions(
            new_ids,
            batch.grid_thw if batch is not None else None,
            self.visual_pads,
            self.model.vision.spatial_merge_size,
            start=start,
            text_before=text_before,
        )
        extra = token_extra_keys(new_ids, self.visual_pads, image_keys(batch), counts, text_before)
        return PreparedTurn(new_ids, extra, messages, positions, next_position, batch, history, text_before, layouts)


def join_batches(first: ImageBatch, second: ImageBatch) -> ImageBatch:
    """One batch of ``first``'s entries, then ``second``'s (a turn's images, then its videos' frame groups)."""
    return ImageBatch(
        pixel_values=torch.cat([first.pixel_values, second.pixel_values]),
        grid_thw=torch.cat([first.grid_thw, second.grid_thw]),
        num_tokens=[*first.num_tokens, *second.num_tokens],
        digests=[*first.digests, *second.digests],
    )


def check_turn(turn: Turn) -> None:
    if not isinstance(turn.text, str):
        raise ValueError(f"prompt text must be a string, got {type(turn.text).__name__}")
    if not turn.text.strip() and not turn.images and not turn.videos:
        raise ValueError("empty prompt: the turn has no text, no image and no video")
    if turn.color not in ("rgb", "bgr"):
        raise ValueError(f"image color must be 'rgb' or 'bgr', got {turn.color!r}")
    for i, image in enumerate(turn.images):
        if not isinstance(image, np.ndarray):
            raise ValueError(f"image {i} must be a numpy array (H, W, C) uint8, got {type(image).__name__}")
