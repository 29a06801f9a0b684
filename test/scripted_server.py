"""A local HTTP server that answers with scripted bodies: what an OpenAI-compatible server may send (chunks of
a stream, error statuses with their messages, bodies that break off), for the remote backend's tests."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from orin_vlm_node.remote.client import Endpoint


class Script:
    """What the server answers: (status, body chunks, delay between chunks) for every request, unless
    ``first`` holds answers for the next POST requests (each taken once, in order), or ``models`` the list
    ``GET /models`` answers; what it received."""

    def __init__(self) -> None:
        self.status, self.chunks, self.delay = 200, [], 0.0
        self.first: list[tuple[int, list[bytes]]] = []
        self.models: list[str] | None = None
        self.requests: list[dict] = []

    def next_answer(self, method: str, path: str) -> tuple[int, list[bytes]]:
        if method == "GET" and path.endswith("/models") and self.models is not None:
            return 200, [json.dumps({"object": "list", "data": [{"id": m} for m in self.models]}).encode()]
        return self.first.pop(0) if self.first and method == "POST" else (self.status, self.chunks)

    def posts(self) -> list[dict]:
        """The bodies of the chat requests received (model-list checks left out)."""
        return [r["body"] for r in self.requests if r["method"] == "POST"]


@contextmanager
def scripted_server(port: int = 0) -> Iterator[tuple[Script, Endpoint]]:
    """A server on 127.0.0.1:``port`` (0: any free one) and its endpoint, for as long as the block runs."""
    script = Script()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            auth = self.headers.get("Authorization")
            received = {"method": self.command, "path": self.path, "auth": auth}
            script.requests.append({**received, "body": json.loads(body) if body else None})
            status, chunks = script.next_answer(self.command, self.path)
            self.send_response(status)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            try:
                for chunk in chunks:
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    time.sleep(script.delay)
            except (BrokenPipeError, ConnectionResetError):
                pass

        do_GET = do_POST = _answer

    httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield script, Endpoint(f"http://127.0.0.1:{httpd.server_address[1]}/v1", api_key="k3y", timeout_s=5.0)
    finally:
        httpd.shutdown()
        httpd.server_close()


def sse(*events: object) -> list[bytes]:
    """Server-sent events, each a JSON object or a literal string (``[DONE]``)."""
    return [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events]
