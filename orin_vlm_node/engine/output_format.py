"""Answers constrained to a format: a JSON schema, a regular expression, or one of several choices.

A robot acts on an answer only if it can read it: "yes" or "no", JSON its planner's schema accepts, a box it
can grasp. The format is compiled (llguidance) into a matcher that, before each token is chosen, says which
tokens may come next; the others' logits become -inf, so greedy decoding and sampling alike only produce
text that still matches, and the answer ends as soon as the format is complete. JSON is compact (no
whitespace between tokens the schema does not ask for): an untrained model must not loop on blanks.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, TimeoutError
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from ..processing import Tokenizer

OutputKind = Literal["json_schema", "regex", "choice"]
KINDS: tuple[str, ...] = ("json_schema", "regex", "choice")
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: "," and ":" with nothing around them


@dataclass(frozen=True)
class OutputFormat:
    """What an answer must match. ``spec``: the schema (a dict), the regex, or the choices (a tuple)."""

    kind: OutputKind
    spec: Any

    def describe(self) -> str:
        """One line for status events and logs."""
        if self.kind == "choice":
            return f"choice of {len(self.spec)}: " + " | ".join(self.spec)
        if self.kind == "regex":
            return f"regex {self.spec}"
        title = self.spec.get("title") if isinstance(self.spec, dict) else None
        return f"json_schema {title}" if isinstance(title, str) else "json_schema"


def parsed_json(value: Any, what: str, kind: type = dict) -> Any:
    """``value`` (JSON text, or already parsed) as a JSON object (``kind`` dict) or array (list); ValueError
    "<what> is not valid JSON" or "<what> must be a JSON object/array"."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(value, kind):
        name = "object" if kind is dict else "array"
        raise ValueError(f"{what} must be a JSON {name}, got {type(value).__name__}")
    return value


def output_format(kind: str, spec: Any) -> OutputFormat:
    """A checked :class:`OutputFormat`; ``spec`` of a schema may be its JSON text. ValueError says what is wrong."""
    if kind not in KINDS:
        raise ValueError(f"output format kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "json_schema":
        return OutputFormat("json_schema", parsed_json(spec, "json_schema"))
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise ValueError("regex must be a non-empty string")
        return OutputFormat("regex", spec)
    choices = tuple(spec) if isinstance(spec, (list, tuple)) else ()
    if not choices or any(not isinstance(c, str) or not c for c in choices):
        raise ValueError("choice needs a list of non-empty strings")
    return OutputFormat("choice", choices)


def format_from_json(value: Any) -> OutputFormat | None:
    """The format written as JSON (or its parsed object): ``{"json_schema": {...}}``, ``{"regex": "..."}`` or
    ``{"choice": [...]}``; '' or ``{}`` is none (free text). ValueError says what is wrong."""
    if isinstance(value, str) and not value.strip():
        return None
    value = parsed_json(value, "output format")
    if not value:
        return None
    if len(value) != 1:
        raise ValueError(f"output format names one of {', '.join(KINDS)}, got {', '.join(map(str, value))}")
    [(kind, spec)] = value.items()
    return output_format(kind, spec)


class Grammars:
    """Compiles output formats for one tokenizer. The tokenizer's token table is built once, on the first
    format (a second or so for Qwen's 151k tokens, so a node that never constrains never pays it);
    ``vocab_size``: the logits' width, which may exceed the tokenizer's (padding rows). Compiled formats are
    kept by content (the last ``CACHED`` of them): a channel's format, or the same detection labels, compile
    once and each answer starts from a copy."""

    CACHED = 64

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, compile_timeout_s: float = 2.0) -> None:
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._table = None
        # content -> the matcher at an answer's start and the tokens it disallows first ((V,) bool, shared: read only)
        self._compiled: OrderedDict[str, tuple[Any, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()  # the node checks a format from its parameter thread
        # Compiles run on a thread of their own (the library releases the GIL), so one that takes longer than
        # compile_timeout_s is refused while the node goes on; it cannot be stopped, and finishes unused.
        self._compile_timeout_s = compile_timeout_s
        self._compiler: ThreadPoolExecutor | None = None

    def compile(self, fmt: OutputFormat) -> Constraint:
        """The matcher of ``fmt`` at the start of an answer; ValueError naming what the format gets wrong."""
        key = json.dumps([fmt.kind, fmt.spec], sort_keys=True)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = self._compiled[key] = self._matcher(fmt)
                while len(self._compiled) > self.CACHED:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(key)
            start, first = compiled
            return Constraint(fmt, start.deep_copy(), self._vocab_size, first)

    def _matcher(self, fmt: OutputFormat) -> tuple[Any, torch.Tensor]:
        import llguidance  # imported when first asked for: a node without formats does not load it

        if self._table is None:
            eos = list(self._tokenizer.eos_token_ids)
            self._table = llguidance.LLTokenizer(
                self._tokenizer.backend_json(), n_vocab=self._vocab_size, eos_token=eos
            )
        if fmt.kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(fmt.spec, defaults=JSON_OPTIONS)
        elif fmt.kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(fmt.spec)
        else:
            grammar = llguidance.grammar_from("choice", list(fmt.spec))
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="output_format_compile")
        compiling = self._compiler.submit(llguidance.LLMatcher, self._table, grammar, log_level=0)
        try:
            matcher = compiling.result(timeout=self._compile_timeout_s)
        except TimeoutError:
            raise ValueError(f"{fmt.kind} took more than {self._compile_timeout_s:g} s to compile: refused") from None
        if matcher.is_error():
            raise ValueError(f"invalid {fmt.kind}: {_first_line(matcher.get_error())}")
        first = _disallowed(matcher, self._vocab_size)
        allowed = ~first
        allowed[list(self._tokenizer.eos_token_ids)] = False
        if not matcher.is_accepting() and not allowed.any():
            raise ValueError(f"{fmt.kind} can never match: no text is allowed from its start")
        return matcher, first


class Constraint:
    """One answer's matcher: masks each row of logits, then takes the token chosen from it. The mask of the
    next token is computed as soon as a token is taken: on a GPU that is while the device computes the step
    the token went into (the engine reads a token after launching the next step)."""

    def __init__(self, fmt: OutputFormat, matcher: Any, vocab_size: int, first: torch.Tensor) -> None:
        """``first``: the tokens the matcher disallows at its start, (V,) bool on the host (never written)."""
        self.format, self._matcher, self._vocab_size = fmt, matcher, vocab_size
        self._next = first  # (V,) bool on the host

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (V,) with every token the format does not allow next at -inf (a new tensor)."""
        disallowed = self._next
        if logits.is_cuda:  # queued in stream order: the host does not wait for the step that made the logits
            disallowed = disallowed.pin_memory().to(logits.device, non_blocking=True)
        return logits.masked_fill(disallowed[: logits.shape[-1]], float("-inf"))

    def take(self, token: int) -> None:
        """The token chosen from the last masked row; ValueError when the format refuses it."""
        if not self._matcher.consume_token(token):
            raise ValueError(f"the output format failed at token {token}: {_first_line(self._matcher.get_error())}")
        if not self.done:
            self._next = _disallowed(self._matcher, self._vocab_size)

    @property
    def done(self) -> bool:
        """Nothing may follow: the format is complete and allows no more text."""
        return self._matcher.is_stopped()

    @property
    def complete(self) -> bool:
        """The answer so far matches the whole format."""
        return self._matcher.is_accepting()

    def result(self, text: str) -> dict[str, Any]:
        """What the answer is, for the Finished event: the format, whether it is complete, and for a complete
        JSON answer its parsed value (else the text)."""
        return answer_output(self.format, text, self.complete)


def answer_output(fmt: OutputFormat, text: str, complete: bool) -> dict[str, Any]:
    """The ``output`` of a Finished event: the format, whether the answer matches all of it, and for a complete
    JSON answer its parsed value (else the text; None when incomplete)."""
    value: Any = text if complete else None
    if complete and fmt.kind == "json_schema":
        value = json.loads(text)
    return {"format": fmt.describe(), "complete": complete, "value": value}


def _disallowed(matcher: Any, vocab_size: int) -> torch.Tensor:
    """The tokens ``matcher`` does not allow next: (vocab_size,) bool on the host. The library gives one bit a
    token, little-endian within each 32-bit word: token 32 w + i is bit i of word w."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return torch.from_numpy(bits[:vocab_size] == 0)


def _first_line(error: str) -> str:
    """The reason of a matcher error (the library appends its whole parser state)."""
    return error.strip().splitlines()[0] if error.strip() else "unknown error"
