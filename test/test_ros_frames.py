"""Frames of several cameras (``image_topics``): what a prompt takes, in order, and what it says about the rest."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("rclpy")  # the ros package's modules come with the ROS wheels

from orin_vlm_node.ros import image as image_module  # noqa: E402
from orin_vlm_node.ros.image import LatestFrames, PickedFrames  # noqa: E402


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


def _frame(value: int) -> np.ndarray:
    return np.full((4, 6, 3), value, dtype=np.uint8)


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
