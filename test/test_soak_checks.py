"""The soak's verdicts (tools/soak.py): every prompt it sent matched to exactly one terminal event by request
id, the node's memory judged after the warm-up, the camera's real rate. A soak that cannot fail where it
matters passes a node that loses prompts or grows without bound."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from tools.soak import Soak, memory_growth_problems

diagnostic_msgs = pytest.importorskip("diagnostic_msgs.msg")


def _soak(events: list[dict], sent: int, rss: list[tuple[float, float, int]] | None = None) -> Soak:
    ok = diagnostic_msgs.DiagnosticStatus(level=diagnostic_msgs.DiagnosticStatus.OK, message="ok")
    client = SimpleNamespace(events=lambda: events, diagnostics=[diagnostic_msgs.DiagnosticArray(status=[ok])])
    soak = Soak(client, SimpleNamespace(alive=lambda: True), random.Random(0), [])
    soak.sent = sent
    soak.rss = rss if rss is not None else [(0.0, 300.0, 0), (50.0, 310.0, 10), (100.0, 312.0, 20), (150.0, 311.0, 30)]
    soak.camera_published, soak.camera_s = 150, 10.0
    return soak


def _end(event: str, request_id: str | None) -> dict:
    return {"event": event, "request_id": request_id, "finish_reason": "stop", "note": None}


def test_every_prompt_ending_once_passes():
    events = [_end("accepted", "req-1"), _end("finished", "req-1"), _end("dropped", "req-2"), _end("error", "req-3")]
    assert _soak(events, sent=3).problems(40.0, 64.0, 15.0) == []


def test_a_camera_error_does_not_stand_in_for_a_lost_prompt():
    """The node publishes ``error`` with no request id for a bad camera frame: counting terminal events would
    have taken it for the end of the prompt that was lost."""
    events = [_end("finished", "req-1"), _end("error", None)]
    assert _soak(events, sent=2).problems(40.0, 64.0, 15.0) == ["1 prompts never ended, the first: req-2"]


def test_a_prompt_ending_twice_and_an_end_of_no_prompt_sent_fail():
    events = [_end("finished", "req-1"), _end("error", "req-1"), _end("dropped", "req-9")]
    problems = _soak(events, sent=1).problems(40.0, 64.0, 15.0)
    assert problems == ["req-1 ended 2 times", "an end of a prompt never sent: req-9"]


def test_memory_is_judged_after_the_warm_up_by_its_floor():
    """Growth during the warm-up does not count, nor a reload's peak that goes again; a rising floor does."""
    warm_up_growth = [(0.0, 327.0, 0), (100.0, 1000.0, 50), (200.0, 1021.0, 90), (300.0, 1030.0, 130),
                      (400.0, 1025.0, 170)]  # fmt: skip
    assert memory_growth_problems(warm_up_growth, 200.0, 64.0) == []
    peaks = [(t, 500.0 + (150.0 if t in (260.0, 340.0) else 0.0), 0) for t in range(200, 400, 20)]
    assert memory_growth_problems([(float(t), mb, n) for t, mb, n in peaks], 200.0, 64.0) == []
    leaking = [(float(t), 400.0 + (t - 200) * 0.8, 0) for t in range(200, 420, 20)]
    assert memory_growth_problems(leaking, 200.0, 64.0) == [
        "memory grew by 128 MB after the warm-up (its floor 400 -> 528 MB), more than 64 MB"
    ]
    assert memory_growth_problems([(0.0, 300.0, 0), (250.0, 310.0, 1)], 200.0, 64.0) == [
        "fewer than three memory samples after the 200 s warm-up: run longer"
    ]


def test_a_camera_slower_than_asked_fails():
    soak = _soak([], sent=0)
    soak.camera_published, soak.camera_s = 27, 10.0
    assert soak.problems(40.0, 64.0, 15.0) == ["the camera published 2.7 frames/s, not the 15 asked"]
