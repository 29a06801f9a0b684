"""Coalesced token publishing (``ros/token_stream.py``) without ROS: a list stands in for the publisher. Publishing
runs on the pushing thread until a publish is slow, then on a publisher thread (``_threaded`` gets there)."""

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


def _threaded(stream: TokenStream, rec: _Recorder) -> None:
    """Move ``stream`` to its publisher thread: a first publish slower than ``SLOW_PUBLISH_S`` (10 ms)."""
    rec.delay_s = 0.05
    stream.push("slow")
    rec.delay_s = 0.0
    assert stream._thread is not None


def test_publishing_runs_on_the_pushing_thread_and_starts_no_thread():
    """A publish costs microseconds; a publisher thread cost generation a GIL hand-over per message."""
    idents: list[int] = []
    before = threading.active_count()
    stream = TokenStream(lambda _text: idents.append(threading.get_ident()), period_s=0.0)
    try:
        stream.push("a")
        stream.push("b")
        assert stream.flush()
        assert threading.active_count() == before
    finally:
        stream.close()
    assert idents == [threading.get_ident()] * 2


def test_a_slow_publish_moves_publishing_off_the_pushing_thread(caplog):
    release = threading.Event()
    idents: list[int] = []

    def publish(text: str) -> None:
        idents.append(threading.get_ident())
        if text == "slow":
            time.sleep(0.05)
        elif text == "stuck":
            release.wait(10.0)

    stream = TokenStream(publish, period_s=0.0)
    try:
        with caplog.at_level("WARNING", logger="orin_vlm_node.ros"):
            stream.push("slow")  # published on this thread, too slowly
        assert "thread of their own" in caplog.text
        stream.push("stuck")  # the publisher thread takes it and hangs in the publish
        stream.push("after")  # returns although the publish before it hangs
        assert stream.flush(timeout_s=0.2) is False
        release.set()
        assert stream.flush(timeout_s=5.0)
    finally:
        release.set()
        stream.close()
    me = threading.get_ident()
    assert idents[0] == me and idents[1] != me and idents[2] != me


def test_the_publisher_thread_coalesces_per_period_and_keeps_order():
    rec = _Recorder()
    stream = TokenStream(rec, period_s=0.05)
    pieces = [f"w{i} " for i in range(60)]
    try:
        _threaded(stream, rec)
        for piece in pieces:
            stream.push(piece)
            time.sleep(0.005)
        assert stream.flush()
        stream.start_answer()
        stream.push("next answer")
        deadline = time.monotonic() + 2.0
        while rec.texts[-1] != "next answer" and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        stream.close()
    assert "".join(rec.texts) == "slow" + "".join(pieces) + "next answer"
    assert len(rec.texts) < len(pieces) / 3
    assert rec.texts[-1] == "next answer"  # the next answer's first delta without a flush


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


def test_deltas_within_a_period_do_not_wake_the_publisher_thread():
    """Each wake-up of the publisher thread takes the GIL from generation: within a period it sleeps the period
    out and takes everything pending at its end, one wake-up per message; only a push after an idle stretch
    (the period over, nothing pending) wakes it."""
    rec = _Recorder()
    stream = TokenStream(rec, period_s=0.5)
    try:
        _threaded(stream, rec)  # "slow" published: a period starts
        time.sleep(0.05)  # the publisher thread waits the period out
        original = stream._cond.notify_all
        calls = []  # wake-ups the pushing thread (this one) gave
        me = threading.get_ident()
        stream._cond.notify_all = lambda: (calls.append(threading.get_ident() == me), original())[1]
        for i in range(50):
            stream.push(f" {i}")
        assert not any(calls)
        deadline = time.monotonic() + 2.0
        while len(rec.messages) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rec.texts == ["slow", "".join(f" {i}" for i in range(50))]  # at the period's end, unprompted
        time.sleep(0.6)  # a period with nothing to publish: the publisher now waits for text
        stream.push(" after a pause")
        assert sum(calls) == 1
        assert stream.flush()
        assert rec.texts[-1] == " after a pause"
    finally:
        stream.close()
