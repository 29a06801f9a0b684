"""Every channel's ``status`` events in order, ``ready`` first, whichever thread reports first.

``status`` is volatile: an event reaches only the subscribers matched to the publisher when it goes out, and
discovery between processes takes milliseconds on an idle machine, seconds on a loaded one. So each channel
announces ``ready`` once its status topic has a subscriber and others that came up with it had a moment to
match too, however late that is (or with the channel's first event of a prompt, if that comes sooner). The
node polls often while subscribers are likely to appear (at startup), then once a second.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, Literal

from std_msgs.msg import String

from .channel import Channel
from .status import status_json

READY_POLL_S = 0.05
READY_SETTLE_S = 0.25
READY_FAST_POLL_S = 10.0
READY_SLOW_POLL_S = 1.0


class StatusEvents:
    """Publishes the channels' events; ``warn`` logs a prompt that ends without an answer."""

    def __init__(self, warn: Callable[[str], None]) -> None:
        self._warn = warn
        self._lock = threading.Lock()  # orders status events; guards _announced
        self._announced: set[str] = set()  # channels whose status has carried ``ready``
        self._note = ""
        self._matched: dict[str, float] = {}  # channel -> when its status first had a subscriber
        self._slow_after: float | None = None

    def start(self, note: str, now: float) -> None:
        """Serving (again): every channel announces ``ready`` with ``note`` (the attention path, the pool)."""
        with self._lock:
            self._announced, self._note, self._matched = set(), note, {}
        self._slow_after = now + READY_FAST_POLL_S

    def publish(self, ch: Channel, event: str, request_id: str | None, fields: dict[str, Any]) -> None:
        """Publish one event on the channel's status. A prompt that ends without an answer (``error``,
        ``dropped``) is logged too: the operator reading the node's log sees every prompt that was lost, and
        why. (Events of no prompt are logged where they arise: image errors throttled, once for every channel
        that watches the camera.)"""
        if request_id is not None and event == "error":
            self._warn(f"{request_id}: {fields.get('error')}")
        elif request_id is not None and event == "dropped":
            self._warn(f"{request_id} dropped: {fields.get('note')}")
        with self._lock:
            first = ch.name not in self._announced
            self._announced.add(ch.name)
            if event == "ready" and not first:
                return  # a prompt's event announced it already
            if first and event != "ready":
                ch.status_pub.publish(String(data=status_json("ready", None, note=self._note)))  # type: ignore[arg-type]
            ch.status_pub.publish(String(data=status_json(event, request_id, **fields)))  # type: ignore[arg-type]

    def poll(self, channels: Iterable[Channel], now: float) -> Literal["", "done", "slow"]:
        """Announce ``ready`` on the channels whose status has had a subscriber for ``READY_SETTLE_S``. "done":
        every channel announced, stop polling; "slow": poll every ``READY_SLOW_POLL_S`` from now on."""
        with self._lock:
            waiting = [ch for ch in channels if ch.name not in self._announced]
        for ch in waiting:
            if ch.status_pub.get_subscription_count() > 0:
                self._matched.setdefault(ch.name, now)
        due = [ch for ch in waiting if ch.name in self._matched and now - self._matched[ch.name] >= READY_SETTLE_S]
        for ch in due:
            ch.status("ready", None, note=self._note)
        if len(due) == len(waiting):
            return "done"
        if self._slow_after is not None and now >= self._slow_after:
            self._slow_after = None
            return "slow"
        return ""
