"""Text tokenizer: a thin wrapper over the checkpoint's ``tokenizer.json`` (HF ``tokenizers``).

Why a wrapper: the engine needs a few facts the raw tokenizer does not give directly (the ids of
the chat/vision special tokens, the stop ids from ``generation_config.json``) and must never add a
BOS token (Qwen has none). Special token ids are looked up by their text in the tokenizer, never
hard-coded, so tiny test tokenizers and real checkpoints go through the same code.

Two encodings: :meth:`Tokenizer.encode` turns special-token text (``<|im_end|>``) into its id, which only
the chat template's own structure may do; :meth:`Tokenizer.encode_plain` encodes such text as ordinary
characters, which is how text from users must be read (a prompt must not be able to close its turn or
end the sequence). :meth:`Tokenizer.encode_prompt` combines them for a rendered prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from .errors import TokenizerError
from .files import read_json_object

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the special tokens the chat format and the vision path use."""

    im_start: int
    im_end: int
    endoftext: int
    vision_start: int
    vision_end: int
    image_pad: int
    video_pad: int


@dataclass(frozen=True)
class RenderedPrompt:
    """Prompt text and where in it the chat template wrote special tokens (``control``: ``[start, end)``
    character spans); special-token text anywhere else came from a message and is plain text."""

    text: str
    control: tuple[tuple[int, int], ...] = field(default=())

    def tail(self, start: int) -> RenderedPrompt:
        """The prompt from character ``start`` on (a control span must not straddle ``start``)."""
        return RenderedPrompt(self.text[start:], tuple((a - start, b - start) for a, b in self.control if a >= start))


class Tokenizer:
    """Encode/decode text with a checkpoint's tokenizer; knows the special and stop token ids."""

    def __init__(self, backend: _HFTokenizer, eos_token_ids: Sequence[int] | None = None):
        self._tok = backend
        # A second backend that reads special-token text as characters (the flag is per backend object,
        # so two objects keep both encodings thread-safe).
        self._plain = _HFTokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True
        added = backend.get_added_tokens_decoder().values()
        self.special_texts: tuple[str, ...] = tuple(t.content for t in added if t.special)
        self.special = SpecialTokens(
            im_start=self._require(IM_START),
            im_end=self._require(IM_END),
            endoftext=self._require(ENDOFTEXT),
            vision_start=self._require(VISION_START),
            vision_end=self._require(VISION_END),
            image_pad=self._require(IMAGE_PAD),
            video_pad=self._require(VIDEO_PAD),
        )
        if eos_token_ids is None or len(eos_token_ids) == 0:
            eos_token_ids = (self.special.im_end, self.special.endoftext)
        self.eos_token_ids: tuple[int, ...] = tuple(int(i) for i in eos_token_ids)
        for i in self.eos_token_ids:
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"eos token id {i} is outside the tokenizer vocabulary ({self.vocab_size})")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (and stop ids from ``generation_config.json`` if present)."""
        root = Path(path)
        file = root / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"no tokenizer.json in {path}")
        try:
            backend = _HFTokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerError(f"cannot load {file}: {exc}") from exc
        return cls(backend, eos_token_ids=_read_eos_ids(root / "generation_config.json"))

    def backend_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what other tokenizer libraries load)."""
        return self._tok.to_str()

    def _require(self, text: str) -> int:
        token_id = self._tok.token_to_id(text)
        if token_id is None:
            raise TokenizerError(f"tokenizer has no {text} token, which Qwen3-VL's chat format needs")
        return token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text become their ids; no BOS."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` read as plain characters: ``<|im_end|>`` in it is ten characters, not a token."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode_plain takes a str, got {type(text).__name__}")
        return self._plain.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, prompt: RenderedPrompt) -> list[int]:
        """Ids of a rendered prompt: its control spans as special tokens, everything between them plain.

        Equal to :meth:`encode` of the text when no message contains special-token text (special tokens
        split the text before anything else in both encodings).
        """
        ids: list[int] = []
        at = 0
        for start, end in prompt.control:
            if start > at:
                ids += self.encode_plain(prompt.text[at:start])
            token = self._tok.token_to_id(prompt.text[start:end])
            if token is None:
                raise TokenizerError(f"control span {prompt.text[start:end]!r} is not a token")
            ids.append(token)
            at = end
        if at < len(prompt.text):
            ids += self.encode_plain(prompt.text[at:])
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; bytes that do not form complete UTF-8 characters become U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _read_eos_ids(file: Path) -> list[int] | None:
    """The stop ids of ``generation_config.json`` (the only place they are read)."""
    cfg = read_json_object(file, TokenizerError)
    eos = cfg.get("eos_token_id") if cfg is not None else None
    if eos is None:
        return None
    ids = [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TokenizerError(f"{file}: eos_token_id must be an int or a list of ints, got {eos!r}")
    return ids
