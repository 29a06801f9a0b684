"""Whether the server answers and lists the model: checked on a thread of its own, read without waiting.

Why a thread: the node's diagnostics run every second on the executor thread that also takes prompts and
parameter changes; a server behind a dead route would hold each check for a whole timeout. The watch asks
``GET /models`` every ``period_s`` (with a short timeout) and the diagnostics read its last answer.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from .client import Endpoint, RemoteError, list_models

PROBE_TIMEOUT_S = 3.0


@dataclasses.dataclass(frozen=True)
class ServerState:
    """The last check: when (monotonic seconds; 0 = not yet), whether the server answered, whether it lists
    the model, and what went wrong ('' when nothing)."""

    checked_at: float = 0.0
    reachable: bool = False
    model_listed: bool = False
    problem: str = "not checked yet"


class ServerWatch:
    """Checks ``endpoint`` for ``model`` every ``period_s`` until :meth:`close`."""

    def __init__(self, endpoint: Endpoint, model: str, period_s: float = 5.0) -> None:
        self._endpoint = dataclasses.replace(endpoint, timeout_s=min(endpoint.timeout_s, PROBE_TIMEOUT_S))
        self._model = model
        self._period_s = period_s
        self._state = ServerState()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="orin_vlm_server_watch", daemon=True)
        self._thread.start()

    @property
    def state(self) -> ServerState:
        return self._state

    def check(self) -> ServerState:
        """Ask the server now (on the calling thread) and keep the answer."""
        try:
            models = list_models(self._endpoint)
        except RemoteError as exc:  # retryable: no answer; else an answer that was an error or no model list
            self._state = ServerState(time.monotonic(), not exc.retryable, False, str(exc))
            return self._state
        listed = self._model in models
        problem = "" if listed else f"model {self._model!r} is not listed by the server (it lists {models[:5]})"
        self._state = ServerState(time.monotonic(), True, listed, problem)
        return self._state

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=PROBE_TIMEOUT_S + 1.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.check()
            self._stop.wait(self._period_s)
