"""Coalesced token publishing: the first delta of an answer at once, then at most one message per period.

Why coalesce: one ROS publish per token was the node's main overhead (serialisation and DDS work for every
token, each taken from the decoder's time). A subscriber that renders or speaks text needs updates at screen
rate, not per token: with a 20 ms period a 400-token answer goes out in a few dozen messages, and the first
delta still leaves at once (time to first token is what an operator feels).

More in docs/modules.md, ``orin_vlm_node/ros/token_stream.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("orin_vlm_node.ros")

SLOW_PUBLISH_S = 0.010  # a publish slower than this moves publishing to a thread of its own


class TokenStream:
    """Deltas pushed by the generation thread, published coalesced on it, or by a publisher thread once a
    publish was slow."""

    def __init__(self, publish: Callable[[str], None], period_s: float) -> None:
        self._publish = publish
        self._period_s = max(0.0, period_s)
        self._cond = threading.Condition()
        self._pending: list[str] = []  # deltas pushed and not yet published, in order
        self._last_publish = float("-inf")  # monotonic time of the last publish of this answer
        self._closed = False
        self._thread: threading.Thread | None = None  # the publisher thread, once a publish was slow
        # Used by the publisher thread only:
        self._in_flight = False  # it is publishing deltas it took
        self._idle = False  # it waits untimed for text (its period is over): the next push wakes it
        self._flushing = 0  # callers waiting in flush(): publish at once, ignore the period

    def set_period(self, period_s: float) -> None:
        """0 publishes every delta as its own message."""
        with self._cond:
            self._period_s = max(0.0, period_s)
            self._cond.notify_all()

    def start_answer(self) -> None:
        """The next delta starts an answer: it is published at once, whatever the last answer did."""
        with self._cond:
            self._last_publish = float("-inf")
            self._cond.notify_all()  # a publisher thread waiting out the last answer's period: wait for text

    def push(self, text: str) -> None:
        """Publish ``text`` now if the period is over, else with the first delta after it (or by ``flush``)."""
        if not text:
            return
        with self._cond:
            if self._closed:
                raise RuntimeError("token stream is closed")
            self._pending.append(text)
            if self._thread is None:
                if time.monotonic() - self._last_publish >= self._period_s:
                    self._publish_pending()
            elif self._idle:  # the publisher thread is woken only when it waits for text
                self._idle = False
                self._cond.notify_all()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Publish everything pushed so far now; False if the publisher thread did not finish within the
        timeout."""
        with self._cond:
            if self._thread is None:
                if self._pending:
                    self._publish_pending()
                return True
            self._flushing += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: not self._pending and not self._in_flight, timeout_s)
            finally:
                self._flushing -= 1

    def close(self, timeout_s: float = 2.0) -> None:
        """Publish what is pending, then refuse more (and stop the publisher thread, if there is one)."""
        with self._cond:
            self._closed = True
            if self._thread is None and self._pending:
                self._publish_pending()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=timeout_s)

    def _send(self, text: str) -> float:
        """Publish one message; how long that took. A failed publish loses the message, never the stream."""
        t0 = time.monotonic()
        try:
            self._publish(text)
        except Exception as exc:
            log.error("publishing tokens failed: %r", exc)
        return time.monotonic() - t0

    def _take_messages(self) -> list[str]:
        """The pending deltas as the messages to publish (the lock held): joined into one, or each alone with
        period 0."""
        taken, self._pending = self._pending, []
        return taken if self._period_s == 0 else ["".join(taken)]

    def _publish_pending(self) -> None:
        """Publish what is pending on the calling thread (with no publisher thread; the lock held). A slow
        publish starts the publisher thread."""
        took = max(self._send(text) for text in self._take_messages())
        self._last_publish = time.monotonic()
        if took > SLOW_PUBLISH_S:
            log.warning(
                "publishing tokens took %.0f ms: they are published from a thread of their own from now on, "
                "so that generation does not wait for a publish",
                took * 1e3,
            )
            self._thread = threading.Thread(target=self._loop, name="orin_vlm_tokens", daemon=True)
            self._thread.start()

    def _take(self) -> list[str] | None:
        """The publisher thread: wait for the next messages (None: closed and drained). Called with the lock
        held."""
        while True:
            wait = self._last_publish + self._period_s - time.monotonic()  # > 0: within the period
            if self._pending and (wait <= 0 or self._flushing or self._closed):
                break
            if self._closed and not self._pending:
                return None
            if wait > 0:  # sleep the period out whether text comes meanwhile or not; pushes do not wake it
                self._cond.wait(wait)
            else:  # nothing pending and the period is over: the next push wakes it and goes out at once
                self._idle = True
                self._cond.wait()
                self._idle = False
        return self._take_messages()

    def _loop(self) -> None:
        while True:
            with self._cond:
                messages = self._take()
                if messages is None:
                    return
                self._in_flight = True
            for text in messages:
                self._send(text)
            with self._cond:
                self._in_flight = False
                self._last_publish = time.monotonic()
                self._cond.notify_all()
