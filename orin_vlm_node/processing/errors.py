"""Errors raised by the processing layer.

They subclass ``ValueError`` so callers that only know "bad input" can catch that; the node turns
them into an error reply for the request instead of crashing.
"""

from __future__ import annotations


class ProcessingError(ValueError):
    """Base class: the input (image, text, conversation) or a checkpoint file cannot be processed."""


class ImageError(ProcessingError):
    """An image cannot be preprocessed (empty, wrong dtype/shape, extreme aspect ratio, bad config)."""


class TokenizerError(ProcessingError):
    """The tokenizer files are missing or lack a token the model needs."""


class ChatTemplateError(ProcessingError):
    """A conversation cannot be rendered (malformed messages, template error, sandbox violation)."""


class PromptError(ProcessingError):
    """Prompt ids cannot be built (e.g. image placeholders and images given do not match)."""
