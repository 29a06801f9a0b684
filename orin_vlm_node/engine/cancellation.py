"""Which requests were asked to stop: the one handle the engine, its scheduler and each request run share.

``cancel`` comes from any thread (a ROS service, a closed stream); a run checks at its next token boundary
or between prefill pieces. A request is known from ``generate`` until its stream ends, so cancelling an
id nobody runs says so instead of marking it for ever.
"""

from __future__ import annotations

import threading


class Cancellations:
    """Thread-safe set of the requests submitted and of those asked to stop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: set[str] = set()  # submitted, stream not ended
        self._cancelled: set[str] = set()

    def submit(self, request_id: str) -> None:
        with self._lock:
            self._known.add(request_id)

    def cancel(self, request_id: str) -> bool:
        """Ask a submitted or running request to stop. False if the id is unknown."""
        with self._lock:
            if request_id not in self._known:
                return False
            self._cancelled.add(request_id)
            return True

    def is_cancelled(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._cancelled

    def forget(self, request_id: str) -> None:
        """The request's stream ended: its id is unknown again."""
        with self._lock:
            self._known.discard(request_id)
            self._cancelled.discard(request_id)
