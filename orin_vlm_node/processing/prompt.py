"""Prompt token ids for a conversation with images: render, tokenize, expand image placeholders.

Why expand after tokenizing: the template writes one ``<|image_pad|>`` per image, but the model needs
one per merged vision patch (``ImageBatch.num_tokens``). Expanding ids instead of text avoids
tokenizing thousands of pad tokens and cannot merge them with neighbouring text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .chat_template import ChatTemplate, count_images, normalize_messages
from .errors import PromptError
from .tokenizer import Tokenizer


def build_prompt_ids(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    image_token_counts: Sequence[int],
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """Token ids of the rendered conversation, the i-th ``<|image_pad|>`` repeated image_token_counts[i] times.

    Raises ``PromptError`` when the images given do not match the image parts of the conversation or
    the placeholders in the rendered prompt (e.g. a user typed ``<|image_pad|>`` into the text, or a
    template drops images), and ``ChatTemplateError`` for malformed conversations.
    """
    counts = list(image_token_counts)
    for i, n in enumerate(counts):
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise PromptError(f"image {i}: token count must be a positive int, got {n!r}")
    plain = normalize_messages(messages)
    n_parts = count_images(plain)
    if n_parts != len(counts):
        raise PromptError(f"the conversation has {n_parts} image part(s) but {len(counts)} image(s) were given")
    text = template.render(plain, add_generation_prompt=add_generation_prompt, **template_kwargs)
    return expand_image_pads(tokenizer.encode(text), tokenizer.special.image_pad, counts)


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
