"""Render conversations into prompt text with the checkpoint's chat template (or built-in ChatML).

Why sandboxed: chat templates ship with checkpoints as Jinja source, i.e. untrusted code. They run
in Jinja's ``ImmutableSandboxedEnvironment`` with unsafe attribute access turned into an immediate
error (plain Jinja would render ``''.__class__`` as an empty string and only fail one step later),
namespaces that refuse underscore names, and conversation data rebuilt from plain str/int/list/dict
values so no Python object with methods reaches the template. The environment options
(trim_blocks, lstrip_blocks, loop controls, a non-HTML-escaping ``tojson``, ``raise_exception``,
``strftime_now``) are the ones Hugging Face templates are written against, so output matches
``transformers``' ``apply_chat_template`` for the same template.

More in docs/modules.md, ``orin_vlm_node/processing/chat_template.py``.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ChatTemplateError
from .files import read_json_object
from .tokenizer import IM_END, IM_START, IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START

ROLES = ("system", "user", "assistant")
# Bounds of one render: a Qwen template renders a long conversation in milliseconds and a prompt longer
# than this many characters could not fit any context this node serves.
RENDER_TIME_LIMIT_S = 2.0
RENDER_MAX_CHARS = 4_000_000
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


# ---------------------------------------------------------------------------------------------
# Message validation


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check a conversation and return a plain copy: roles, str content or text/image/video parts only."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ChatTemplateError("messages is empty")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"message {i} must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
        if "content" not in message:
            raise ChatTemplateError(f"message {i} ({role}) has no 'content'")
        out.append({"role": role, "content": _normalize_content(message["content"], i)})
    return out


def _normalize_content(content: Any, index: int) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return str(content)  # drops str subclasses and their methods
    if isinstance(content, (bytes, Mapping)) or not isinstance(content, Sequence):
        raise ChatTemplateError(
            f"message {index} content must be a str or a list of parts, got {type(content).__name__}"
        )
    parts: list[dict[str, str]] = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ChatTemplateError(f"message {index} part {j} must be a dict, got {type(part).__name__}")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatTemplateError(
                    f"message {index} part {j} (text) needs a str 'text', got {type(text).__name__}"
                )
            parts.append({"type": "text", "text": str(text)})
        elif kind in ("image", "video"):
            parts.append({"type": kind})
        else:
            raise ChatTemplateError(
                f"message {index} part {j} has unsupported type {kind!r} (use 'text', 'image' or 'video')"
            )
    return parts


def count_images(messages: Sequence[Mapping[str, Any]], kind: str = "image") -> int:
    """Number of image (or ``kind``) parts in a (normalised) conversation."""
    return sum(
        1 for m in messages if not isinstance(m["content"], str) for part in m["content"] if part.get("type") == kind
    )


# ---------------------------------------------------------------------------------------------
# Sandbox


class _Sandbox(ImmutableSandboxedEnvironment):
    """Immutable sandbox in which touching an unsafe attribute fails right away with SecurityError, and
    ``*``, ``**`` and ``%`` refuse results larger than a render may build."""

    intercepted_binops = frozenset({"*", "**", "%"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if (
                    isinstance(seq, (str, list, tuple))
                    and isinstance(times, int)
                    and len(seq) * times > RENDER_MAX_CHARS
                ):
                    raise ChatTemplateError(f"chat template builds a value of {len(seq) * times} items (limit "
                                            f"{RENDER_MAX_CHARS})")  # fmt: skip
        elif operator == "**" and isinstance(right, int) and abs(right) > 4096 and left not in (0, 1, -1):
            raise ChatTemplateError(f"chat template raises a number to the power {right} (limit 4096)")
        elif operator == "%" and isinstance(left, str):
            widths = [int(w) for w in re.findall(r"%[-+ #0]*(\d+)", left)]
            if widths and max(widths) > RENDER_MAX_CHARS:
                raise ChatTemplateError(f"chat template formats a field {max(widths)} characters wide")
        return super().call_binop(context, operator, left, right)


class _RenderBudget:
    """Stops a render that runs too long or builds too much, from a trace function on the template's own
    frames (Jinja compiles a template to Python code whose file name is ``<template>``): every line of
    template code checks the clock and the sizes of the values the frame holds."""

    def __init__(self, time_limit_s: float, max_chars: int) -> None:
        self._deadline = time.monotonic() + time_limit_s
        self._time_limit_s = time_limit_s
        self._max_chars = max_chars

    def __enter__(self) -> _RenderBudget:
        self._previous = sys.gettrace()
        sys.settrace(self._on_call)
        return self

    def __exit__(self, *_exc: Any) -> None:
        sys.settrace(self._previous)

    def _on_call(self, frame: Any, event: str, _arg: Any) -> Any:
        return self._on_line if frame.f_code.co_filename == "<template>" else None

    def _on_line(self, frame: Any, event: str, _arg: Any) -> Any:
        if event == "line":
            self.check_time()
            for value in frame.f_locals.values():
                self.check_size(_size(value))
        return self._on_line

    def check_time(self) -> None:
        if time.monotonic() > self._deadline:
            raise ChatTemplateError(f"chat template took longer than {self._time_limit_s:g} s to render")

    def check_size(self, size: int) -> None:
        if size > self._max_chars:
            raise ChatTemplateError(f"chat template built {size} characters (limit {self._max_chars})")


def _size(value: Any) -> int:
    """Characters a template value holds: a string's length, a namespace's longest string."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, jinja2.utils.Namespace):
        return max((len(v) for v in value._Namespace__attrs.values() if isinstance(v, str)), default=0)
    return 0


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` for templates that refuses underscore-prefixed names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - mirrors jinja2.utils.Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates may not store underscore-prefixed names ({name!r}) in a namespace")


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template refused the conversation: {message}")


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and '; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _plain(value: Any) -> Any:
    """Rebuild extra template arguments from JSON types so no object with methods reaches the template."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {str(_plain(k)): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise ChatTemplateError(f"chat template argument of type {type(value).__name__} is not allowed (JSON types only)")


def _compile(source: str, origin: str) -> jinja2.Template:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"chat template from {origin} has a syntax error at line {exc.lineno}: {exc.message}"
        ) from exc


# ---------------------------------------------------------------------------------------------
# Built-in ChatML (Qwen3-VL Instruct semantics)


def render_chatml(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, add_vision_id: bool = False
) -> str:
    """ChatML as Qwen3-VL Instruct renders it: no default system prompt; each image part
    becomes ``<|vision_start|><|image_pad|><|vision_end|>`` (``Picture N: `` first if add_vision_id), each
    video part ``<|vision_start|><|video_pad|><|vision_end|>`` (``Video N: ``)."""
    pieces: list[str] = []
    numbers = {"image": 0, "video": 0}
    for message in normalize_messages(messages):
        pieces.append(f"{IM_START}{message['role']}\n")
        content = message["content"]
        if isinstance(content, str):
            pieces.append(content)
        else:
            for part in content:
                if part["type"] == "text":
                    pieces.append(part["text"])
                else:
                    kind = part["type"]
                    numbers[kind] += 1
                    if add_vision_id:
                        pieces.append(f"{'Picture' if kind == 'image' else 'Video'} {numbers[kind]}: ")
                    pieces.append(f"{VISION_START}{IMAGE_PAD if kind == 'image' else VIDEO_PAD}{VISION_END}")
        pieces.append(f"{IM_END}\n")
    if add_generation_prompt:
        pieces.append(f"{IM_START}assistant\n")
    return "".join(pieces)


# ---------------------------------------------------------------------------------------------
# Template


class ChatTemplate:
    """A checkpoint's chat template (sandboxed Jinja) or, when it has none, built-in ChatML."""

    def __init__(
        self,
        source: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        origin: str = "a template string",
    ) -> None:
        self.source = source
        self.origin = origin if source is not None else "built-in ChatML"
        self._special = {k: v for k, v in (special_tokens or {}).items() if isinstance(v, str)}
        self._template = _compile(source, origin) if source is not None else None

    @property
    def is_builtin(self) -> bool:
        return self._template is None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ChatTemplate:
        """Template of a checkpoint dir: chat_template.jinja, else chat_template.json, else the
        "chat_template" of tokenizer_config.json, else built-in ChatML."""
        root = Path(path)
        tok_cfg = read_json_object(root / "tokenizer_config.json", ChatTemplateError) or {}
        special = {k: _token_text(tok_cfg.get(k)) for k in _SPECIAL_TOKEN_KEYS}
        special = {k: v for k, v in special.items() if v is not None}
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(jinja_file.read_text(encoding="utf-8"), special, origin=str(jinja_file))
        json_cfg = read_json_object(root / "chat_template.json", ChatTemplateError)
        if json_cfg and json_cfg.get("chat_template"):
            return cls(
                _pick_template(json_cfg["chat_template"], "chat_template.json"),
                special,
                origin=str(root / "chat_template.json"),
            )
        if tok_cfg.get("chat_template"):
            return cls(
                _pick_template(tok_cfg["chat_template"], "tokenizer_config.json"),
                special,
                origin=str(root / "tokenizer_config.json"),
            )
        return cls(None, special)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Prompt text of a conversation. Extra keyword arguments (e.g. ``add_vision_id=True``) are
        passed to the template as variables; they must be JSON-like values."""
        plain_messages = normalize_messages(messages)
        extra = {str(k): _plain(v) for k, v in kwargs.items()}
        if self._template is None:
            return render_chatml(plain_messages, add_generation_prompt, add_vision_id=bool(extra.get("add_vision_id")))
        variables = {**self._special, **extra}
        variables.update(messages=plain_messages, add_generation_prompt=bool(add_generation_prompt))
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        try:
            return self._render_bounded(variables)
        except ChatTemplateError:
            raise
        except SecurityError as exc:
            raise ChatTemplateError(f"chat template from {self.origin} was blocked by the sandbox: {exc}") from exc
        except Exception as exc:  # any template runtime error (TypeError, UndefinedError, ...)
            raise ChatTemplateError(f"chat template from {self.origin} failed: {type(exc).__name__}: {exc}") from exc

    def _render_bounded(self, variables: dict[str, Any]) -> str:
        """The template's output, piece by piece, within the time and size bounds of one render."""
        assert self._template is not None
        pieces: list[str] = []
        length = 0
        with _RenderBudget(RENDER_TIME_LIMIT_S, RENDER_MAX_CHARS) as budget:
            for piece in self._template.generate(**variables):
                length += len(piece)
                budget.check_size(length)
                budget.check_time()
                pieces.append(piece)
        return "".join(pieces)


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick_template(value: Any, where: str) -> str:
    """A template field is a string or a list of {"name", "template"}; use the one named "default"."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ChatTemplateError(f"{where} lists chat templates {sorted(map(str, named))} but none named 'default'")
    raise ChatTemplateError(f"{where} chat_template must be a string, got {type(value).__name__}")
