"""The node's bounded prompt queue: the newest prompts win, and no channel waits behind another's burst.

Why drop the *oldest*: on a robot a question asked a while ago about an old camera frame is worth
less than the one just asked, and a bounded queue keeps the latency of the newest prompt bounded.
Every dropped item is returned to the caller so it can publish a ``dropped`` event for it; nothing
disappears silently.

More in docs/modules.md, ``orin_vlm_node/ros/request_queue.py``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from ..engine.events import SamplingParams
from ..engine.output_format import OutputFormat
from .frame_history import PickedVideos
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
    channel: str = ""  # the asker's channel; "" = the node's only one
    output: OutputFormat | None = None  # what the answer must match (None: free text)
    detect: tuple[str, ...] = ()  # a detection request: the labels (its answer is published as detections)
    videos: PickedVideos = PickedVideos()  # the cameras' recent past, when the prompt asks about time

    @property
    def note(self) -> str | None:
        return "; ".join(n for n in (self.frames.note, self.videos.note) if n) or None

    def status_fields(self) -> dict[str, Any]:
        """The status fields that say which frames the prompt uses and the format its answer must match."""
        fields: dict[str, Any] = {"image_stamp": self.frames.first_stamp, "images": self.frames.used}
        if self.videos.videos:
            fields["videos"] = self.videos.used
        if self.output is not None:
            fields["output_format"] = self.output.describe()
        return fields


class RequestQueue:
    """Thread-safe FIFO per channel with a bound each; ``put`` beyond the bound evicts the channel's oldest
    waiting items; ``get`` takes the channels in turn."""

    def __init__(self, max_size: int) -> None:
        if max_size < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_size}")
        self._items: dict[str, deque[PendingPrompt]] = {}  # channel -> its waiting prompts; order = turn order
        self._max = max_size
        self._cond = threading.Condition()
        self._wakeups = 0

    def __len__(self) -> int:
        with self._cond:
            return sum(len(items) for items in self._items.values())

    def waiting(self, channel: str) -> int:
        with self._cond:
            return len(self._items.get(channel, ()))

    @property
    def max_size(self) -> int:
        return self._max

    def put(self, item: PendingPrompt) -> list[PendingPrompt]:
        """Append ``item`` to its channel; return the items evicted to respect the bound (oldest first)."""
        with self._cond:
            self._items.setdefault(item.channel, deque()).append(item)
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

    def get(
        self, timeout: float, skip: Collection[str] = (), held: Callable[[], bool] = lambda: False
    ) -> PendingPrompt | None:
        """The oldest item of the next channel in turn that has one (channels in ``skip`` left out: they are
        busy), waiting up to ``timeout`` s; None on timeout, after :meth:`wake`, or when ``held()`` is true as
        an item would be taken (asked under the queue's lock, so what was decided before an item was put
        holds it back: the worker's engine changes go before the prompts that came after them). The channel
        served goes to the back of the turn order."""
        with self._cond:
            if timeout > 0:  # (the worker asks with 0 between the tokens of running answers: no waiter made)
                seen = self._wakeups
                self._cond.wait_for(lambda: self._has_items(skip) or self._wakeups != seen, timeout=timeout)
            for channel, items in self._items.items():
                if items and channel not in skip:
                    if held():
                        return None
                    item = items.popleft()
                    del self._items[channel]
                    self._items[channel] = items  # dicts keep insertion order: now last in turn
                    return item
            return None

    def drain(self, channel: str | None = None) -> list[PendingPrompt]:
        """Remove and return every waiting item (of ``channel`` only, when given)."""
        with self._cond:
            items = []
            for name, waiting in self._items.items():
                if channel is None or name == channel:
                    items += waiting
                    waiting.clear()
            return items

    def wake(self) -> None:
        """Make a waiting :meth:`get` return now (the worker has other work: reconfigure, stop)."""
        with self._cond:
            self._wakeups += 1
            self._cond.notify_all()

    def _has_items(self, skip: Collection[str]) -> bool:
        return any(items for channel, items in self._items.items() if channel not in skip)

    def _trim(self) -> list[PendingPrompt]:
        dropped = []
        for items in self._items.values():
            while len(items) > self._max:
                dropped.append(items.popleft())
        return dropped
