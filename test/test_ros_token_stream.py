"""Coalesced token publishing (``ros/token_stream.py``) without ROS: a list stands in for the publisher."""

from __future__ import annotations

import threading
import time

import pytest

from orin_vlm_node.ros.token_stream import TokenStream


class _Recorder:
    """A publish function that records (time, text) and can be made slow."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.messages: list[tuple[float, str]] = []
        self.delay_s = delay_s
        self.first = threading.Event()

    def __call__(self, text: str) -> None:
        time.sleep(self.delay_s)
        self.messages.append((time.monotonic(), text))
        self.first.set()

    @property
    def texts(self) -> list[str]:
        return [t for _, t in self.messages]


def test_first_delta_leaves_at_once_then_the_rest_is_joined_per_period():
    rec = _Recorder()
    stream = TokenStream(rec, period_s=0.3)
    try:
        t0 = time.monotonic()
        stream.push("Hel")
        assert rec.first.wait(2.0)
        assert rec.messages[0][0] - t0 < 0.25  # not held back for a period
        for piece in ["lo", ", ", "wor", "ld", "!"]:
            stream.push(piece)
        assert stream.flush()
        assert rec.texts == ["Hel", "lo, world!"]
    finally:
        stream.close()


def test_at_most_one_message_per_period_while_generating():
    rec = _Recorder()
    period = 0.05
    stream = TokenStream(rec, period_s=period)
    pieces = [f"w{i} " for i in range(100)]
    try:
        t0 = time.monotonic()
        for piece in pieces:  # about 0.5 s of "generation", one delta per 5 ms
            stream.push(piece)
            time.sleep(0.005)
        assert stream.flush()
        elapsed = time.monotonic() - t0
    finally:
        stream.close()
    assert "".join(rec.texts) == "".join(pieces)  # nothing lost, order kept
    assert len(rec.texts) <= elapsed / period + 2
    assert len(rec.texts) < len(pieces) / 3
    gaps = [b - a for (a, _), (b, _) in zip(rec.messages, rec.messages[1:], strict=False)]
    assert min(gaps[:-1], default=period) >= period * 0.9  # the last one may be a flush


def test_period_zero_publishes_every_delta_on_its_own():
    rec = _Recorder()
    stream = TokenStream(rec, period_s=0.0)
    pieces = ["一", "二", "三", " four", " 五"]
    try:
        for piece in pieces:
            stream.push(piece)
        assert stream.flush()
    finally:
        stream.close()
    assert rec.texts == pieces


def test_a_slow_publisher_never_blocks_the_pushing_thread():
    rec = _Recorder(delay_s=0.2)
    stream = TokenStream(rec, period_s=0.0)
    try:
        t0 = time.monotonic()
        for i in range(10):
            stream.push(str(i))
        pushed_in = time.monotonic() - t0
        assert pushed_in < 0.1  # ten publishes take 2 s; pushing does not wait for them
        assert stream.flush(timeout_s=10.0)
    finally:
        stream.close()
    assert "".join(rec.texts) == "0123456789"


def test_flush_returns_false_when_the_publisher_is_stuck():
    release = threading.Event()
    stream = TokenStream(lambda _text: release.wait(5.0), period_s=0.0)
    try:
        stream.push("x")
        assert stream.flush(timeout_s=0.2) is False
    finally:
        release.set()
        stream.close()


def test_start_answer_sends_the_next_answers_first_delta_at_once():
    rec = _Recorder()
    stream = TokenStream(rec, period_s=1.0)
    try:
        stream.push("first answer")
        assert stream.flush()
        stream.start_answer()
        t0 = time.monotonic()
        stream.push("second")
        deadline = time.monotonic() + 2.0
        while len(rec.messages) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert rec.texts == ["first answer", "second"]
        assert rec.messages[1][0] - t0 < 0.5  # not after the 1 s period
    finally:
        stream.close()


def test_a_failing_publish_is_logged_and_the_stream_goes_on(caplog):
    calls: list[str] = []

    def publish(text: str) -> None:
        calls.append(text)
        if len(calls) == 1:
            raise RuntimeError("publisher gone")

    stream = TokenStream(publish, period_s=0.0)
    try:
        with caplog.at_level("ERROR", logger="orin_vlm_node.ros"):
            stream.push("a")
            stream.push("b")
            assert stream.flush()
    finally:
        stream.close()
    assert calls == ["a", "b"]
    assert "publishing tokens failed" in caplog.text


def test_close_publishes_what_is_pending_and_refuses_more():
    rec = _Recorder()
    stream = TokenStream(rec, period_s=10.0)
    stream.push("a")
    assert rec.first.wait(2.0)
    stream.push("b")  # held back by the 10 s period
    stream.close()
    assert rec.texts == ["a", "b"]
    with pytest.raises(RuntimeError, match="closed"):
        stream.push("c")


def test_deltas_within_a_period_do_not_wake_the_publisher_thread_each():
    """A wake-up per token made the publisher thread take the GIL from generation at every step."""
    rec = _Recorder()
    stream = TokenStream(rec, period_s=0.5)
    try:
        stream.push("first")
        assert rec.first.wait(2.0)
        time.sleep(0.05)  # the publisher is back waiting out its period
        original = stream._cond.notify_all
        calls = []
        stream._cond.notify_all = lambda: (calls.append(1), original())[1]
        for i in range(50):
            stream.push(f" {i}")
        assert len(calls) <= 1  # the first delta after a publish (the publisher may wait untimed), not 50
        assert stream.flush()
        assert "".join(rec.texts) == "first" + "".join(f" {i}" for i in range(50))
    finally:
        stream.close()
