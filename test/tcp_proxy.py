"""A TCP proxy on 127.0.0.1 between the node and a server, with the faults of a real network path: it refuses
connections (nothing listens), delays the server's first bytes, cuts a stream after some bytes of the
answer, or answers an HTTP error itself. Faults apply to chat requests (``POST``), so the node's model-list
checks pass through; each takes the fault set when its request arrived."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass


@dataclass
class Fault:
    """What the next connections get: ``delay_s`` before the server's first bytes, a cut after ``cut_after``
    bytes of the server's answer, or an HTTP ``status`` with ``body`` (the server never asked); ``times``:
    how many connections get it (0: all), after which they pass through."""

    delay_s: float = 0.0
    cut_after: int = 0
    status: int = 0
    body: bytes = b""
    times: int = 0


class TcpProxy:
    """Forwards 127.0.0.1:``port`` to ``target`` (host, port) until :meth:`close`."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.fault = Fault()
        self.connections = 0
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.listen()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def listen(self) -> None:
        """Accept connections again (after :meth:`refuse`)."""
        listener = socket.create_server(("127.0.0.1", self.port), reuse_port=True)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def refuse(self) -> None:
        """Stop listening: connecting is refused until :meth:`listen`."""
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (a close alone leaves it listening)
            except OSError:
                pass
            listener.close()

    def close(self) -> None:
        self.refuse()

    def _take_fault(self) -> Fault:
        with self._lock:
            self.connections += 1
            fault = self.fault
            if fault.times:
                fault.times -= 1
                if not fault.times:
                    self.fault = Fault()
            return fault

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client:
            try:
                first = client.recv(65536)
            except OSError:
                return
            fault = self._take_fault() if first.startswith(b"POST") else Fault()
            if fault.status:
                _read_request(client, first)  # all of it: a client still sending would not read the answer
                head = f"HTTP/1.1 {fault.status} Fault\r\nContent-Length: {len(fault.body)}\r\nConnection: close\r\n"
                client.sendall(head.encode() + b"\r\n" + fault.body)
                return
            with socket.create_connection(self.target) as server:
                server.sendall(first)
                threading.Thread(target=_pipe, args=(client, server, 0.0, 0), daemon=True).start()
                _pipe(server, client, fault.delay_s, fault.cut_after)


def _read_request(client: socket.socket, data: bytes) -> None:
    """Read the rest of an HTTP request whose first bytes are ``data`` (headers, then Content-Length bytes)."""
    while b"\r\n\r\n" not in data and (more := client.recv(65536)):
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    lengths = [line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
    while len(body) < int(lengths[0] if lengths else 0) and (more := client.recv(65536)):
        body += more


def _pipe(source: socket.socket, sink: socket.socket, delay_s: float, cut_after: int) -> None:
    """Copy ``source`` to ``sink`` until either closes; wait ``delay_s`` before the first bytes; after
    ``cut_after`` bytes (0: never), shut both down."""
    sent = 0
    try:
        while data := source.recv(65536):
            if delay_s and not sent:
                time.sleep(delay_s)
            if cut_after and sent + len(data) >= cut_after:
                sink.sendall(data[: cut_after - sent])
                break
            sink.sendall(data)
            sent += len(data)
    except OSError:
        pass
    for sock in (source, sink):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
