"""Streaming detokenizer: turns generated ids into text deltas without splitting UTF-8 characters.

Why: with byte-level BPE one token can hold part of a character (a Chinese character is 3 bytes,
an emoji 4, and merges may cut across characters). Decoding each token alone would print U+FFFD
and lose the character. Instead we keep two offsets into the generated ids:

    ids[prefix:read]   already emitted; its text is cached (``_prefix_text``)
    ids[prefix:]       decoded again after every push (a few tokens, so O(1) per token)

More in docs/modules.md, ``orin_vlm_node/processing/detokenizer.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

from .tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


def token_spans(tokenizer: Tokenizer, token_ids: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """(start, end) characters of each token in the text an answer streamed (special tokens skipped); a token
    inside a character is empty, the character counted with the token that completes it."""
    detokenizer, spans, end = IncrementalDetokenizer(tokenizer, skip_special_tokens=True), [], 0
    for token in token_ids:
        start, end = end, end + len(detokenizer.push(token))
        spans.append((start, end))
    return tuple(spans)


class IncrementalDetokenizer:
    """Push generated token ids one at a time; get the text they complete."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: first id of the last emitted chunk
        self._read = 0  # everything before this id has been emitted
        self._prefix_text = ""  # decode(ids[prefix:read]), cached

    @property
    def token_ids(self) -> list[int]:
        """All ids pushed so far (a copy)."""
        return list(self._ids)

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text (may be "")."""
        self._ids.append(int(token_id))
        text = self._tokenizer.decode(self._ids[self._prefix :], skip_special_tokens=self._skip_special)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete or invalid tail, as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        text = self._tokenizer.decode(self._ids[self._prefix :], skip_special_tokens=self._skip_special)
        return self._advance(text)

    def _advance(self, text: str) -> str:
        delta = text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        # Decoded on its own (not sliced from ``text``) so decoders that treat a window start specially
        # see the same start in the next push's decode.
        self._prefix_text = self._tokenizer.decode(self._ids[self._prefix :], skip_special_tokens=self._skip_special)
        return delta
