"""The engine's interface served by an OpenAI-compatible server: what the node and the CLI call when
``backend`` is ``openai``.

Why the same interface: everything the robot sees (topics, channels, status events, metrics, sessions,
cancel, formats, detections) is built on the engine's events, so a remote server slots in below them and
nothing above changes. The node keeps each session's messages and sends the whole conversation every turn;
the server's prefix cache reuses it. A failure before the first token is retried with backoff (a server
restarting, a moment of network loss); after it, the answer ends with an ``error`` naming the cause.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

from ..engine.config import check_fields, sampling_from_settings
from ..engine.events import Event, Finished, Request, SamplingParams, TextDelta
from ..engine.output_format import OutputFormat, answer_output
from .client import ChatStream, Endpoint, RemoteError
from .messages import Conversation, request_body, user_message
from .server_watch import ServerWatch

RETRY_DELAYS_S = (0.25, 0.5, 1.0, 2.0)
# The settings a server honours; the others (KV cache, kernels, device, image limits) belong to a local model.
REMOTE_FIELDS = frozenset({"max_batch", "max_sessions", "max_context_tokens", "sampling"})


@dataclasses.dataclass(frozen=True)
class RemoteConfig:
    """Where the server is, which model, how frames travel, requests at once, conversations kept, the tokens
    a conversation may grow to before it starts over, and the default sampling."""

    endpoint: Endpoint
    model: str
    image_format: str = "jpeg"
    max_batch: int = 8
    max_sessions: int = 0
    max_context_tokens: int = 4096
    sampling: SamplingParams = SamplingParams()


def remote_config(values: Mapping[str, Any], max_batch: int, max_sessions: int = 0) -> RemoteConfig:
    """The ``remote`` settings as a RemoteConfig; ValueError when the URL, the model or the key is missing."""
    if not values["remote_model"]:
        raise ValueError("backend openai needs remote_model: the model as the server's GET /v1/models lists it")
    key_env = values["remote_api_key_env"]
    key = os.environ.get(key_env) if key_env else None
    if key_env and not key:
        raise ValueError(f"remote_api_key_env names {key_env}, which is not set in the node's environment")
    endpoint = Endpoint(values["remote_url"], key, float(values["remote_timeout_s"]), values["remote_ca_bundle"])
    return RemoteConfig(endpoint, values["remote_model"], values["remote_image_format"], max_batch, max_sessions,
                        int(values["max_context_tokens"]), sampling_from_settings(values))  # fmt: skip


@dataclasses.dataclass
class _Answer:
    """What a stream delivered so far: text pieces, each token's probability and the characters it wrote,
    the server's usage and finish reason, the time to the first text."""

    text: list[str] = dataclasses.field(default_factory=list)
    probs: list[float] = dataclasses.field(default_factory=list)
    spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    usage: dict[str, Any] = dataclasses.field(default_factory=dict)
    reason: str | None = None
    ttft: float | None = None
    length: int = 0

    def take(self, chunk: Mapping[str, Any], t0: float) -> str:
        """Read one chunk; the text it adds. A chunk's tokens all get the chunk's characters."""
        self.usage = chunk.get("usage") or self.usage
        added = ""
        for choice in chunk.get("choices") or []:
            delta = (choice.get("delta") or {}).get("content") or ""
            start, self.length = self.length, self.length + len(delta)
            for entry in (choice.get("logprobs") or {}).get("content") or []:
                self.probs.append(math.exp(entry["logprob"]))
                self.spans.append((start, self.length))
            self.reason = choice.get("finish_reason") or self.reason
            if delta:
                self.ttft = self.ttft if self.ttft is not None else time.perf_counter() - t0
                self.text.append(delta)
                added += delta
        return added


class RemoteEngine:
    """Generation on a remote server, with the local engine's events, sessions and cancellation."""

    def __init__(self, config: RemoteConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._streams: dict[str, ChatStream | None] = {}  # request id -> its open stream (None: not yet open)
        self._cancelled: set[str] = set()
        self._sessions: OrderedDict[str, Conversation] = OrderedDict()  # least recently used first
        self._last_error = ""
        self._last_metrics: dict[str, float] = {}
        self._watch = ServerWatch(config.endpoint, config.model)

    @property
    def max_batch(self) -> int:
        return self.config.max_batch

    def generate(self, request: Request) -> Iterator[Event]:
        if request.request_id is None:
            request.request_id = uuid.uuid4().hex
        with self._lock:
            self._streams[request.request_id] = None
        return self._serve(request)

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            if request_id not in self._streams:
                return False
            self._cancelled.add(request_id)
            stream = self._streams[request_id]
        if stream is not None:
            stream.close()
        return True

    def reset(self, session_id: str | None = None) -> None:
        with self._lock:
            if session_id is None:
                self._sessions.clear()
            else:
                self._sessions.pop(session_id, None)

    def shortest_prompt_tokens(self, system_prompt: str | None) -> int:
        """0: the server's tokenizer counts; a prompt longer than its context comes back as its error."""
        return 0

    def validate_changes(self, **fields: Any) -> None:
        """ValueError for a bad value, or for a setting only a local model has (the server decides those)."""
        check_fields(fields)
        local = sorted(set(fields) - REMOTE_FIELDS)
        if local:
            raise ValueError(f"{', '.join(local)}: a local model's setting; with backend openai the server decides")

    def validate_output(self, fmt: OutputFormat) -> None:
        """Nothing to check here: the server compiles the format and refuses one it cannot (an error event)."""

    def reconfigure(self, **fields: Any) -> None:
        """Apply new settings to the next requests (ValueError, nothing changed, for invalid ones)."""
        self.validate_changes(**fields)
        with self._lock:
            self.config = dataclasses.replace(self.config, **fields)
            while len(self._sessions) > self.config.max_sessions:
                self._sessions.popitem(last=False)

    def close(self) -> None:
        """Close every open stream (the server stops generating) and stop watching the server."""
        with self._lock:
            streams = [s for s in self._streams.values() if s is not None]
            self._cancelled.update(self._streams)
        for stream in streams:
            stream.close()
        self._watch.close()

    def describe(self) -> dict:
        """The server, the model and the last check of both (never waits on the network)."""
        state = self._watch.state
        return {
            "backend": "openai",
            "remote_url": self.config.endpoint.url,
            "remote_model": self.config.model,
            "server_reachable": state.reachable,
            "model_listed": state.model_listed,
            "server_problem": state.problem,
            "last_error": self._last_error,
            "sessions": len(self._sessions),
            "last_metrics": dict(self._last_metrics),
        }

    def _conversation(self, request: Request) -> tuple[Conversation, int]:
        """The request's conversation (a new one without a session) and the tokens of one that was full and
        starts over with this prompt."""
        if not request.session_id or not self.config.max_sessions:
            return Conversation(), 0
        with self._lock:
            conversation = self._sessions.pop(request.session_id, None) or Conversation()
            forgotten = 0
            if conversation.tokens >= self.config.max_context_tokens:
                conversation, forgotten = Conversation(), conversation.tokens
            self._sessions[request.session_id] = conversation
            while len(self._sessions) > self.config.max_sessions:
                self._sessions.popitem(last=False)
        return conversation, forgotten

    def _serve(self, request: Request) -> Iterator[Event]:
        rid, t0, answer = request.request_id, time.perf_counter(), _Answer()
        try:
            conversation, forgotten = self._conversation(request)
            messages = conversation.with_turn(
                request.system_prompt, user_message(request.turn, self.config.image_format)
            )
            stream = self._open(rid, request_body(self.config.model, request, messages, self.config.sampling))
            if stream is None:
                yield self._finished(request, "cancelled", answer, t0)
                return
            for chunk in stream:
                added = answer.take(chunk, t0)
                if added:
                    yield TextDelta(rid, added, ())
        except (RemoteError, ValueError) as exc:
            if rid not in self._cancelled and answer.reason is None:
                self._last_error = str(exc)
                yield self._finished(request, "error", answer, t0, str(exc))
                return
        finally:
            with self._lock:
                self._streams.pop(rid, None)
        cancelled = rid in self._cancelled
        self._cancelled.discard(rid)
        reason = "length" if answer.reason == "length" else "stop"
        finished = self._finished(request, "cancelled" if cancelled and answer.reason is None else reason, answer, t0)
        if request.session_id and finished.finish_reason != "cancelled":
            tokens = int(answer.usage.get("total_tokens", 0))
            conversation.keep(messages, finished.text, tokens)
        if forgotten:
            finished.metrics["forgotten_tokens"] = float(forgotten)
        yield finished

    def _open(self, rid: str, body: dict) -> ChatStream | None:
        """The request's stream, retried with backoff while nothing was generated; None when cancelled."""
        for delay in (*RETRY_DELAYS_S, None):
            if rid in self._cancelled:
                return None
            try:
                stream = ChatStream(self.config.endpoint, body)
            except RemoteError as exc:
                if not exc.retryable or delay is None:
                    raise
                time.sleep(delay)
                continue
            with self._lock:
                self._streams[rid] = stream
            return stream
        return None

    def _finished(self, request: Request, reason: str, answer: _Answer, t0: float, error: str | None = None):
        total = time.perf_counter() - t0
        # A cancelled stream ends before the usage chunk: then the deltas count (vLLM streams one per token).
        generated = float(answer.usage.get("completion_tokens", len(answer.text)))
        decode_s = total - (answer.ttft or total)
        metrics = {
            "ttft_s": answer.ttft or 0.0,
            "decode_tokens_per_s": (generated - 1) / decode_s if decode_s > 0 and generated > 1 else 0.0,
            "prompt_tokens": float(answer.usage.get("prompt_tokens", 0)),
            "generated_tokens": generated,
            "total_s": total,
        }
        self._last_metrics = metrics
        text = "".join(answer.text)
        output = None
        if request.output is not None:
            output = answer_output(request.output, text, reason == "stop" and _matches(request.output, text))
        scored = request.token_probs and error is None
        return Finished(request.request_id, reason, text, (), metrics, error, output,  # type: ignore[arg-type]
                        tuple(answer.probs) if scored else None, tuple(answer.spans) if scored else None)  # fmt: skip


def _matches(fmt: OutputFormat, text: str) -> bool:
    """Whether a finished answer is what the server was held to (its grammar ran there, not here)."""
    if fmt.kind == "json_schema":
        try:
            json.loads(text)
        except ValueError:
            return False
        return True
    if fmt.kind == "regex":
        return re.fullmatch(fmt.spec, text) is not None
    return text in fmt.spec
