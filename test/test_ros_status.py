"""Status event JSON and diagnostics flattening (ros_status)."""

from __future__ import annotations

import json

from orin_vlm_node.ros.status import TERMINAL_EVENTS, diagnostic_values, request_note, status_json

KEYS = {
    "event", "request_id", "finish_reason", "error", "metrics", "image_stamp", "images", "videos", "note", "changes",
    "output_format", "output",
}  # fmt: skip


def test_every_event_has_the_same_keys():
    for event in ("accepted", "started", "finished", "error", "dropped", "reconfigured"):
        assert set(json.loads(status_json(event, "req-1"))) == KEYS


def test_finished_event_round_trips():
    doc = json.loads(
        status_json(
            "finished",
            "req-3",
            finish_reason="length",
            metrics={"ttft_s": 0.25, "generated_tokens": 8.0},
            image_stamp=12.5,
            images=(("front", 12.5), ("wrist", 12.25)),
            output_format="choice of 2: yes | no",
            output={"format": "choice of 2: yes | no", "complete": True, "value": "yes"},
        )
    )
    assert doc == {
        "event": "finished",
        "request_id": "req-3",
        "finish_reason": "length",
        "error": None,
        "metrics": {"ttft_s": 0.25, "generated_tokens": 8.0},
        "image_stamp": 12.5,
        "images": [{"topic": "front", "stamp": 12.5}, {"topic": "wrist", "stamp": 12.25}],
        "videos": None,
        "note": None,
        "changes": None,
        "output_format": "choice of 2: yes | no",
        "output": {"format": "choice of 2: yes | no", "complete": True, "value": "yes"},
    }


def test_non_finite_metrics_become_null_and_text_stays_unicode():
    raw = status_json("error", None, error="bild ungültig: 图像", metrics={"x": float("nan"), "y": float("inf")})
    assert "图像" in raw  # not \\u escaped, readable in `ros2 topic echo`
    doc = json.loads(raw)
    assert doc["metrics"] == {"x": None, "y": None} and doc["request_id"] is None


def test_reconfigured_carries_changes():
    doc = json.loads(status_json("reconfigured", changes={"use_paged_attention": False, "kv_pool_mb": 64.0}))
    assert doc["changes"] == {"use_paged_attention": False, "kv_pool_mb": 64.0}


def test_terminal_events():
    assert TERMINAL_EVENTS == {"finished", "dropped", "error"}


def test_diagnostic_values_flatten_and_format():
    values = diagnostic_values({"device": "cpu", "pool": {"used": 3, "total": 64}, "tok_s": 123.456789, "ok": True})
    assert values == [("device", "cpu"), ("ok", "True"), ("pool.total", "64"), ("pool.used", "3"), ("tok_s", "123.5")]


def test_a_preempted_request_says_so_in_its_note():
    metrics = {"preemptions": 2.0, "preempted_tokens": 131.0}
    assert request_note(metrics, "rear: no image received yet") == (
        "rear: no image received yet; preempted 2x when the KV pool ran out (131 tokens freed and recomputed)"
    )
    assert request_note({"preemptions": 0.0}, None) is None
    assert request_note({}, "a remark") == "a remark"


def test_a_conversation_that_started_over_says_so_in_its_note():
    metrics = {"forgotten_tokens": 4016.0, "preemptions": 0.0}
    assert request_note(metrics, "rear: no image received yet") == (
        "rear: no image received yet; the conversation was full (4016 tokens of earlier turns): "
        "it started over with this prompt"
    )
    assert request_note({"forgotten_tokens": 0.0}) is None
