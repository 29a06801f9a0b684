"""A client of an OpenAI-compatible chat-completions server (vLLM, SGLang, llama.cpp's server, Ollama):
streaming by server-sent events, standard library only.

Why the standard library: the robot gains no dependency for talking to a server, and every byte that crosses
the network passes through code we test (timeouts, TLS with a CA bundle, a stream that ends mid-answer, a body
that is not JSON). A stream can be closed from another thread: the server sees its connection close and
stops generating.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

MAX_LINE = 1 << 20  # a server-sent line longer than this is malformed: memory stays bounded


class RemoteError(RuntimeError):
    """The server could not be reached or refused the request. ``retryable``: worth trying again (refused or
    reset connection, a timeout, a 5xx or 429 answer); a 4xx names a mistake that a retry repeats."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class Endpoint:
    """Where the server is: ``url`` its API root (``http://gpu-box:8000/v1``), the key sent as a bearer token
    (None: none), the timeout of a connection and of every read, and a CA bundle for https ('' = the
    system's)."""

    url: str
    api_key: str | None = None
    timeout_s: float = 30.0
    ca_bundle: str = ""

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"remote_url must be an http:// or https:// URL with a host, got {self.url!r}")

    def connection(self) -> http.client.HTTPConnection:
        parts = urlsplit(self.url)
        if parts.scheme == "http":
            return http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.timeout_s)
        context = ssl.create_default_context(cafile=self.ca_bundle or None)
        return http.client.HTTPSConnection(parts.hostname, parts.port, timeout=self.timeout_s, context=context)

    def path(self, route: str) -> str:
        return urlsplit(self.url).path.rstrip("/") + route

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


def _request(endpoint: Endpoint, method: str, route: str, body: dict | None):
    """Send one request; (connection, response) with a 200 status, else RemoteError with the server's message."""
    conn = endpoint.connection()
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, endpoint.path(route), body=data, headers=endpoint.headers())
        response = conn.getresponse()
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        raise RemoteError(f"{endpoint.url} unreachable: {_reason(exc)}", retryable=True) from exc
    if response.status != 200:
        message = _error_message(response.read(MAX_LINE))
        conn.close()
        retry = response.status >= 500 or response.status == 429
        raise RemoteError(f"the server answered {response.status}: {message}", retryable=retry)
    return conn, response


def _reason(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout):
        return "timed out"
    return str(exc) or type(exc).__name__


def _error_message(body: bytes) -> str:
    """The ``error.message`` (or ``message``/``detail``) of an error body, else its text."""
    text = body.decode("utf-8", "replace").strip()
    try:
        doc = json.loads(text)
    except ValueError:
        return text[:500] or "(no body)"
    if isinstance(doc, dict):
        err = doc.get("error")
        found = err.get("message") if isinstance(err, dict) else err or doc.get("message") or doc.get("detail")
        if found:
            return str(found)[:500]
    return text[:500]


def list_models(endpoint: Endpoint) -> list[str]:
    """The model ids ``GET /models`` lists; RemoteError when the server is unreachable or the body is not the
    OpenAI list."""
    conn, response = _request(endpoint, "GET", "/models", None)
    try:
        doc = json.loads(response.read(MAX_LINE))
        return [str(m["id"]) for m in doc["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise RemoteError(f"GET {endpoint.path('/models')}: not a model list ({exc})") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise RemoteError(f"{endpoint.url} unreachable: {_reason(exc)}", retryable=True) from exc
    finally:
        conn.close()


class ChatStream:
    """One streaming chat completion: iterating gives each chunk's JSON (a dict) until ``data: [DONE]``;
    RemoteError when the stream breaks, stalls past the timeout or carries what is not JSON. ``close`` (any
    thread) ends it; iteration then stops without an error."""

    def __init__(self, endpoint: Endpoint, body: dict[str, Any]) -> None:
        self._closed = threading.Event()
        self._lock = threading.Lock()  # guards _reading and the connection's closing
        self._reading = False  # a thread iterates: it closes the connection when it stops
        self._conn, self._response = _request(endpoint, "POST", "/chat/completions", {**body, "stream": True})

    def __iter__(self) -> Iterator[dict[str, Any]]:
        with self._lock:
            if self._closed.is_set():
                return
            self._reading = True
        try:
            for data in self._events():
                if data == "[DONE]":
                    return
                try:
                    chunk = json.loads(data)
                except ValueError as exc:
                    raise RemoteError(f"the server sent an event that is not JSON: {data[:200]!r}") from exc
                if not isinstance(chunk, dict):
                    raise RemoteError(f"the server sent an event that is not a JSON object: {data[:200]!r}")
                if "error" in chunk:
                    raise RemoteError(f"the server failed mid-answer: {_error_message(data.encode())}")
                yield chunk
            if not self._closed.is_set():
                raise RemoteError("the server closed the stream before it finished", retryable=True)
        finally:
            with self._lock:
                self._closed.set()
                self._reading = False
                self._conn.close()

    def _events(self) -> Iterator[str]:
        """The data of each server-sent event (its ``data:`` lines joined); comments and other fields skipped."""
        lines: list[str] = []
        while not self._closed.is_set():
            try:
                raw = self._response.readline(MAX_LINE + 1)
            except (OSError, http.client.HTTPException, ValueError) as exc:
                if self._closed.is_set():
                    return
                raise RemoteError(f"the stream broke: {_reason(exc)}", retryable=True) from exc
            if not raw:
                return
            if len(raw) > MAX_LINE:
                raise RemoteError(f"the server sent a line over {MAX_LINE} bytes")
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if not line:
                if lines:
                    yield "\n".join(lines)
                    lines = []
            elif line.startswith("data:"):
                lines.append(line[5:].removeprefix(" "))

    def close(self) -> None:
        """End the stream from any thread: its socket is shut down, so the server sees the connection close
        and stops generating, and a read blocked in the iterating thread returns. That thread closes the
        connection (two threads closing one ``http.client`` response race); here only when none iterates."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            try:
                self._conn.sock and self._conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            if not self._reading:
                self._conn.close()
