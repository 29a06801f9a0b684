"""Prompt ids of a conversation turn: the first turn in full, later turns as the delta after the cache.

A session's KV ends right after the assistant's ``<|im_end|>``; the next turn must add exactly the
tokens a fresh rendering of the whole conversation would have after that point (``\\n<|im_start|>user
\\n...<|im_end|>\\n<|im_start|>assistant\\n`` for ChatML), or the model would see a conversation that no
single rendering produces. The delta is therefore cut from the checkpoint's own template: render the
conversation with and without the new turn and take what follows the last ``<|im_end|>`` of the
history. Templates that rewrite earlier turns (e.g. strip reasoning from old answers) break that
prefix property; they are detected and reported instead of silently diverging.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..processing import ChatTemplate, PromptError, Tokenizer, build_prompt_ids, expand_image_pads, render_prompt
from ..processing.prompt import expand_video_pads, video_ids
from ..processing.tokenizer import IM_END
from ..processing.video import VideoLayout
from .events import Turn


def user_message(turn: Turn) -> dict:
    """The chat-template message of a turn: its images first (in order), then its videos, then its text."""
    parts: list[dict] = [{"type": "image"} for _ in turn.images] + [{"type": "video"} for _ in turn.videos]
    if turn.text:
        parts.append({"type": "text", "text": turn.text})
    return {"role": "user", "content": parts}


class ConversationRenderer:
    """Renders turns to token ids with the checkpoint's tokenizer and chat template."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate):
        self.tokenizer = tokenizer
        self.template = template

    def first_turn(
        self,
        system_prompt: str | None,
        turn: Turn,
        image_tokens: Sequence[int],
        prompt_special_tokens: bool = False,
        videos: Sequence[VideoLayout] = (),
    ) -> tuple[list[int], list[dict]]:
        """(prompt ids, messages) of a conversation's first turn, generation prompt included; message text
        is plain text unless ``prompt_special_tokens`` (see ``processing.prompt``)."""
        messages: list[dict] = []
        if system_prompt:
            messages.append({"role": "system", "content": system_prompt})
        messages.append(user_message(turn))
        ids = build_prompt_ids(
            self.tokenizer,
            self.template,
            messages,
            list(image_tokens),
            prompt_special_tokens=prompt_special_tokens,
            videos=videos,
        )
        return ids, messages

    def next_turn(
        self,
        history: list[dict],
        answer_text: str,
        turn: Turn,
        image_tokens: Sequence[int],
        prompt_special_tokens: bool = False,
        videos: Sequence[VideoLayout] = (),
    ) -> tuple[list[int], list[dict]]:
        """(ids after the history's final ``<|im_end|>``, messages incl. the answer and the new turn)."""
        before = [*history, {"role": "assistant", "content": answer_text}]
        after = [*before, user_message(turn)]
        specials = self.tokenizer.special_texts
        prompt_before = render_prompt(self.template, before, specials, False, prompt_special_tokens)
        prompt_after = render_prompt(self.template, after, specials, True, prompt_special_tokens)
        closing = [end for start, end in prompt_before.control if prompt_before.text[start:end] == IM_END]
        if not closing:
            raise PromptError(
                "the chat template does not close assistant turns with <|im_end|>; cannot continue a session"
            )
        anchor = closing[-1]
        if prompt_after.text[:anchor] != prompt_before.text[:anchor]:
            raise PromptError(
                "the chat template renders earlier turns differently once a new turn is added, so the cached "
                "session cannot be continued; reset the session"
            )
        ids = self.tokenizer.encode_prompt(prompt_after.tail(anchor))
        ids = expand_video_pads(ids, self.tokenizer.special, video_ids(self.tokenizer, videos))
        return expand_image_pads(ids, self.tokenizer.special.image_pad, image_tokens), after
