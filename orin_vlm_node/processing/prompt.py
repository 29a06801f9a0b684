"""Prompt token ids for a conversation with images: render, tokenize, expand image placeholders.

Why expand after tokenizing: the template writes one ``<|image_pad|>`` per image, but the model needs
one per merged vision patch (``ImageBatch.num_tokens``). Expanding ids instead of text avoids
tokenizing thousands of pad tokens and cannot merge them with neighbouring text.

More in docs/modules.md, ``orin_vlm_node/processing/prompt.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .chat_template import ChatTemplate, count_images, normalize_messages
from .errors import PromptError
from .tokenizer import RenderedPrompt, SpecialTokens, Tokenizer
from .video import VideoLayout, timestamp_text

# Stands in for each character of special-token text inside a message while the template's own special
# tokens are located (a private-use character: no template writes it, no special token contains it).
_MASK = "\ue000"


def render_prompt(
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    special_texts: Sequence[str],
    add_generation_prompt: bool = True,
    prompt_special_tokens: bool = False,
    **template_kwargs: Any,
) -> RenderedPrompt:
    """The rendered conversation and the spans of its control tokens: the special tokens the template
    wrote, or with ``prompt_special_tokens`` every special-token text in it.

    When a message contains special-token text, the conversation is rendered a second time with that text
    masked by characters of the same length: the special tokens still present there are the template's,
    at the same places in the real rendering. PromptError when the two renderings do not line up (a
    template that reacts to the masked text), since the structure could then not be told from the text.
    """
    plain = normalize_messages(messages)
    text = template.render(plain, add_generation_prompt=add_generation_prompt, **template_kwargs)
    if not special_texts:
        return RenderedPrompt(text)
    pattern = re.compile("|".join(re.escape(t) for t in sorted(special_texts, key=len, reverse=True)))
    masked = _masked(plain, pattern) if not prompt_special_tokens else None
    if masked is None:
        return RenderedPrompt(text, tuple(m.span() for m in pattern.finditer(text)))
    reference = template.render(masked, add_generation_prompt=add_generation_prompt, **template_kwargs)
    control = tuple(m.span() for m in pattern.finditer(reference))
    if len(reference) != len(text) or any(reference[a:b] != text[a:b] for a, b in control):
        raise PromptError(
            "a message contains special-token text and the chat template renders it in a way that hides which "
            "special tokens are the template's; remove the special-token text from the message"
        )
    return RenderedPrompt(text, control)


def _masked(messages: list[dict[str, Any]], pattern: re.Pattern[str]) -> list[dict[str, Any]] | None:
    """The messages with special-token text replaced by masks of equal length; None when none has any."""

    def mask(text: str) -> str:
        return pattern.sub(lambda m: _MASK * len(m.group()), text)

    found = False
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            found |= pattern.search(content) is not None
            content = mask(content)
        else:
            found |= any(pattern.search(p["text"]) for p in content if p["type"] == "text")
            content = [{**p, "text": mask(p["text"])} if p["type"] == "text" else p for p in content]
        out.append({**message, "content": content})
    return out if found else None


def build_prompt_ids(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    image_token_counts: Sequence[int],
    add_generation_prompt: bool = True,
    prompt_special_tokens: bool = False,
    videos: Sequence[VideoLayout] = (),
    **template_kwargs: Any,
) -> list[int]:
    """Token ids of the rendered conversation, the i-th ``<|image_pad|>`` repeated image_token_counts[i] times,
    the i-th video's placeholder replaced by its timestamped frame groups (:func:`expand_video_pads`).

    Message text is plain text unless ``prompt_special_tokens``. Raises ``PromptError`` when the images given do
    not match the image parts of the conversation or the placeholders in the rendered prompt (a template
    that drops images; with ``prompt_special_tokens``, ``<|image_pad|>`` typed into a message), and
    ``ChatTemplateError`` for malformed conversations.
    """
    counts = list(image_token_counts)
    for i, n in enumerate(counts):
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise PromptError(f"image {i}: token count must be a positive int, got {n!r}")
    plain = normalize_messages(messages)
    n_parts = count_images(plain)
    if n_parts != len(counts):
        raise PromptError(f"the conversation has {n_parts} image part(s) but {len(counts)} image(s) were given")
    n_videos = count_images(plain, "video")
    if n_videos != len(videos):
        raise PromptError(f"the conversation has {n_videos} video part(s) but {len(videos)} video(s) were given")
    rendered = render_prompt(
        template, plain, tokenizer.special_texts, add_generation_prompt, prompt_special_tokens, **template_kwargs
    )
    ids = expand_video_pads(tokenizer.encode_prompt(rendered), tokenizer.special, video_ids(tokenizer, videos))
    return expand_image_pads(ids, tokenizer.special.image_pad, counts)


def video_ids(tokenizer: Tokenizer, videos: Sequence[VideoLayout]) -> list[list[int]]:
    """Per video, the ids that stand for it (:func:`frame_group_ids`)."""
    s = tokenizer.special
    return [frame_group_ids(v, tokenizer.encode_plain, s.vision_start, s.video_pad, s.vision_end) for v in videos]


def frame_group_ids(
    video: VideoLayout, encode: Callable[[str], list[int]], vision_start: int, video_pad: int, vision_end: int
) -> list[int]:
    """The ids that stand for one video: each frame group's timestamp text (``encode``d as plain text), then
    ``<|vision_start|>``, its ``<|video_pad|>`` tokens and ``<|vision_end|>`` (the layout Qwen3-VL was trained
    with; the training tool builds its clips' prompts with it too)."""
    ids: list[int] = []
    for seconds in video.timestamps:
        ids += encode(timestamp_text(seconds))
        ids += [vision_start, *[video_pad] * video.group_tokens, vision_end]
    return ids


def expand_video_pads(ids: Sequence[int], special: SpecialTokens, videos: Sequence[Sequence[int]]) -> list[int]:
    """Replace the i-th ``<|vision_start|><|video_pad|><|vision_end|>`` of ``ids`` with ``videos[i]``.

    Qwen's processor (and vLLM) replace the template's whole triple, so no outer vision pair encloses the
    frame groups (transformers 5 keeps one; the model was not trained so). PromptError when the
    placeholders and the videos do not match."""
    found = [i for i, t in enumerate(ids) if t == special.video_pad]
    if len(found) != len(videos):
        raise PromptError(
            f"the rendered prompt has {len(found)} video placeholder(s) but {len(videos)} video(s) were given "
            "(text must not contain <|video_pad|>; the chat template must render every video part)"
        )
    out: list[int] = []
    at = 0
    for i, expansion in zip(found, videos, strict=True):
        if i == 0 or i + 1 >= len(ids) or ids[i - 1] != special.vision_start or ids[i + 1] != special.vision_end:
            raise PromptError("the chat template does not enclose a video in <|vision_start|> and <|vision_end|>")
        out += ids[at : i - 1]
        out += expansion
        at = i + 2
    return out + list(ids[at:])


def expand_image_pads(ids: Sequence[int], pad: int, image_token_counts: Sequence[int]) -> list[int]:
    """Repeat the i-th ``<|image_pad|>`` of ``ids`` ``image_token_counts[i]`` times (one placeholder per image).

    Raises ``PromptError`` when the placeholders and the images do not match (text must not contain
    ``<|image_pad|>``; the chat template must render every image part).
    """
    n_pads = sum(1 for t in ids if t == pad)
    if n_pads != len(image_token_counts):
        raise PromptError(
            f"the rendered prompt has {n_pads} image placeholder(s) but {len(image_token_counts)} image(s) were "
            "given (text must not contain <|image_pad|>; the chat template must render every image part)"
        )
    out: list[int] = []
    image = 0
    for t in ids:
        if t == pad:
            out.extend([pad] * image_token_counts[image])
            image += 1
        else:
            out.append(t)
    return out
