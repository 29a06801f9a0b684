"""Coalesced token publishing: the first delta of an answer at once, then at most one message per period.

Why: one ROS publish per token on the generation thread was the node's main overhead (serialisation and
DDS work for every token, each taken from the decoder's time). A subscriber that renders or speaks text
needs updates at screen rate, not per token: with a 20 ms period a 400-token answer goes out in a few
dozen messages, and the first delta still leaves at once (time to first token is what an operator feels).

Publishing runs on a thread of its own, so a slow or blocking publish never stalls generation; the
generation thread only appends text under a lock. Deltas are whole characters, so joining them never
splits a UTF-8 character, and the messages concatenate to exactly the pushed text: the joined ``tokens``
stay equal to ``response``. ``flush`` waits until everything pushed so far is out; the node calls it
before publishing ``response`` so that no token message trails its answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("orin_vlm_node.ros")


class TokenStream:
    """Deltas pushed by the generation thread, published coalesced by a publisher thread."""

    def __init__(self, publish: Callable[[str], None], period_s: float, name: str = "orin_vlm_tokens") -> None:
        self._publish = publish
        self._period_s = max(0.0, period_s)
        self._cond = threading.Condition()
        self._pending: list[str] = []  # deltas not yet taken by the publisher thread, in order
        self._in_flight = False  # the publisher thread is publishing deltas it took
        self._last_publish = float("-inf")  # monotonic time of the last publish of this answer
        self._flushing = 0  # callers waiting in flush(): publish at once, ignore the period
        self._closed = False
        self.messages = 0  # messages published since start (for metrics and tests of the coalescing)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def set_period(self, period_s: float) -> None:
        """0 publishes every delta as its own message."""
        with self._cond:
            self._period_s = max(0.0, period_s)
            self._cond.notify_all()

    def start_answer(self) -> None:
        """The next delta starts an answer: it is published at once, whatever the last answer did."""
        with self._cond:
            self._last_publish = float("-inf")

    def push(self, text: str) -> None:
        """Queue ``text`` for publishing; never blocks on the publish itself."""
        if not text:
            return
        with self._cond:
            if self._closed:
                raise RuntimeError("token stream is closed")
            self._pending.append(text)
            # Wake the publisher only when it waits for text: with deltas pending it sleeps until its period
            # ends anyway, and a wake-up per token made it take the GIL from generation every step.
            if len(self._pending) == 1 and not self._in_flight:
                self._cond.notify_all()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Publish everything pushed so far now; False if the publisher did not finish within the timeout."""
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: not self._pending and not self._in_flight, timeout_s)
            finally:
                self._flushing -= 1

    def close(self, timeout_s: float = 2.0) -> None:
        """Publish what is pending, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)

    def _take(self) -> list[str] | None:
        """Wait for the next message's deltas (None: closed and drained). Called with the lock held."""
        while True:
            if self._pending:
                wait = self._last_publish + self._period_s - time.monotonic()
                if wait <= 0 or self._flushing or self._closed:
                    break
                self._cond.wait(wait)
            elif self._closed:
                return None
            else:
                self._cond.wait()
        if self._period_s == 0:
            return [self._pending.pop(0)]
        taken, self._pending = self._pending, []
        return taken

    def _loop(self) -> None:
        while True:
            with self._cond:
                taken = self._take()
                if taken is None:
                    return
                self._in_flight = True
            try:
                self._publish("".join(taken))
            except Exception as exc:  # a failed publish loses one message, never the stream
                log.error("publishing tokens failed: %r", exc)
            with self._cond:
                self._in_flight = False
                self._last_publish = time.monotonic()
                self.messages += 1
                self._cond.notify_all()
