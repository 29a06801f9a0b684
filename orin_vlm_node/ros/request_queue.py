"""The node's bounded prompt queue: the newest prompts win.

Why drop the *oldest*: on a robot a question asked a while ago about an old camera frame is worth
less than the one just asked, and a bounded queue keeps the latency of the newest prompt bounded.
Every dropped item is returned to the caller so it can publish a ``dropped`` event for it; nothing
disappears silently.

Plain Python (no ROS), shared between the subscription callbacks (put) and the worker thread (get).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..engine.events import SamplingParams
from .image import PickedFrames


@dataclass
class PendingPrompt:
    """A prompt accepted by the node, waiting for the worker.

    Sampling settings and the images are fixed when the prompt arrives (what the user saw and had
    set when asking); the session is chosen when it starts, after any pending reset.
    """

    request_id: str
    text: str
    sampling: SamplingParams
    system_prompt: str | None
    frames: PickedFrames = PickedFrames()  # the cameras' frames it asks about, and why others are missing
    accepted_at: float = 0.0  # time.monotonic()

    @property
    def note(self) -> str | None:
        return self.frames.note

    def image_fields(self) -> dict[str, Any]:
        """The status fields that say which frames the prompt uses."""
        return {"image_stamp": self.frames.first_stamp, "images": self.frames.used}


class RequestQueue:
    """Thread-safe FIFO with a bound; ``put`` beyond the bound evicts the oldest waiting items."""

    def __init__(self, max_size: int) -> None:
        if max_size < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_size}")
        self._items: deque[PendingPrompt] = deque()
        self._max = max_size
        self._cond = threading.Condition()
        self._wakeups = 0

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    @property
    def max_size(self) -> int:
        return self._max

    def put(self, item: PendingPrompt) -> list[PendingPrompt]:
        """Append ``item``; return the items evicted to respect the bound (oldest first)."""
        with self._cond:
            self._items.append(item)
            dropped = self._trim()
            self._cond.notify_all()
            return dropped

    def set_max_size(self, max_size: int) -> list[PendingPrompt]:
        """Change the bound; return the items evicted by a smaller bound."""
        if max_size < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_size}")
        with self._cond:
            self._max = max_size
            return self._trim()

    def get(self, timeout: float) -> PendingPrompt | None:
        """The oldest item, waiting up to ``timeout`` s; None on timeout or after :meth:`wake`."""
        with self._cond:
            seen = self._wakeups
            if not self._items:
                self._cond.wait_for(lambda: self._items or self._wakeups != seen, timeout=timeout)
            return self._items.popleft() if self._items else None

    def drain(self) -> list[PendingPrompt]:
        """Remove and return every waiting item."""
        with self._cond:
            items = list(self._items)
            self._items.clear()
            return items

    def wake(self) -> None:
        """Make a waiting :meth:`get` return now (the worker has other work: reconfigure, stop)."""
        with self._cond:
            self._wakeups += 1
            self._cond.notify_all()

    def _trim(self) -> list[PendingPrompt]:
        dropped: list[PendingPrompt] = []
        while len(self._items) > self._max:
            dropped.append(self._items.popleft())
        return dropped
