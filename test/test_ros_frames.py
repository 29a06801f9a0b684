"""Frames of several cameras (``image_topics``): what a prompt takes, in order, and what it says about the rest;
each frame converted only when a prompt takes it, at most once, and a frame that does not convert reported."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("rclpy")  # the ros package's modules come with the ROS wheels

from orin_vlm_node.ros import image as image_module  # noqa: E402
from orin_vlm_node.ros.image import ImageConversionError, LatestFrames, PickedFrames  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(image_module.time, "monotonic", c)
    return c


class Conversion:
    """A frame's conversion that counts its runs; ``error`` makes it fail as a corrupt frame does."""

    def __init__(self, value: int, error: str | None = None) -> None:
        self.value, self.error, self.runs = value, error, 0

    def __call__(self) -> np.ndarray:
        self.runs += 1
        if self.error is not None:
            raise ImageConversionError(self.error)
        return np.full((4, 6, 3), self.value, dtype=np.uint8)


def _frame(value: int) -> Conversion:
    return Conversion(value)


def test_fresh_frames_come_in_topic_order_not_arrival_order(clock):
    frames = LatestFrames(["head", "wrist", "rear"])
    frames.set("rear", _frame(3), 10.3)
    frames.set("head", _frame(1), 10.1)
    frames.set("wrist", _frame(2), 10.2)
    picked = frames.pick(2.0)
    assert [int(img[0, 0, 0]) for img in picked.images] == [1, 2, 3]
    assert picked.used == (("head", 10.1), ("wrist", 10.2), ("rear", 10.3))
    assert picked.first_stamp == 10.1 and picked.note is None


def test_missing_and_stale_cameras_are_named(clock):
    frames = LatestFrames(["head", "wrist", "rear"])
    frames.set("wrist", _frame(2), 7.0)
    clock.now += 5.0
    frames.set("head", _frame(1), 12.0)
    picked = frames.pick(2.0)
    assert picked.used == (("head", 12.0),)
    assert picked.note == ("wrist: image ignored: received 5.0 s ago (image_max_age_s=2); rear: no image received yet")


def test_one_camera_keeps_the_single_image_behaviour(clock):
    frames = LatestFrames(["image"])
    assert frames.pick(2.0) == PickedFrames()  # no frame yet: a text prompt, nothing to remark
    frames.set("image", _frame(9), 3.5)
    clock.now += 3.0
    stale = frames.pick(2.0)
    assert stale.images == () and stale.note == "image ignored: received 3.0 s ago (image_max_age_s=2)"
    assert frames.pick(0.0) == PickedFrames()  # images off


def test_newest_frame_of_a_topic_wins(clock):
    frames = LatestFrames(["head"])
    frames.set("head", _frame(1), 1.0)
    frames.set("head", _frame(2), 2.0)
    picked = frames.pick(1.0)
    assert picked.used == (("head", 2.0),) and int(picked.images[0][0, 0, 0]) == 2


def test_frames_are_converted_when_taken_and_only_once(clock):
    frames = LatestFrames(["head"])
    skipped, kept = _frame(1), _frame(2)
    frames.set("head", skipped, 1.0)
    frames.set("head", kept, 2.0)
    assert skipped.runs == 0 and kept.runs == 0  # nothing converted on arrival
    first, second = frames.pick(1.0), frames.pick(1.0)
    assert skipped.runs == 0 and kept.runs == 1  # the newest frame, once for two prompts
    assert first.images[0] is second.images[0] and int(first.images[0][0, 0, 0]) == 2


def test_a_frame_that_does_not_convert_is_reported_and_the_others_still_used(clock):
    frames = LatestFrames(["head", "wrist"])
    corrupt = Conversion(1, error="compressed image rejected: cannot decode compressed image (jpeg)")
    frames.set("head", corrupt, 5.0)
    frames.set("wrist", _frame(2), 6.0)
    picked = frames.pick(2.0)
    assert picked.used == (("wrist", 6.0),)
    assert picked.note == "head: compressed image rejected: cannot decode compressed image (jpeg)"
    assert picked.errors == (("head", "compressed image rejected: cannot decode compressed image (jpeg)", 5.0),)
    assert frames.pick(2.0).errors == picked.errors and corrupt.runs == 1  # remembered, not decoded again
    frames.set("head", _frame(3), 7.0)  # the camera recovers
    recovered = frames.pick(2.0)
    assert recovered.used == (("head", 7.0), ("wrist", 6.0)) and recovered.errors == () and recovered.note is None
