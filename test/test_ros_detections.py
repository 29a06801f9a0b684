"""A detection request's messages: ``detections_json`` with each frame's stamp and frame_id, and the
``vision_msgs/Detection2DArray`` built against the fields vision_msgs documents (4.x, Humble and later:
``Detection2D.header``, ``results[].hypothesis.class_id/score``, ``bbox.center.position.x/y``, ``bbox.size_x/y``,
``id``), which is not on PyPI: stand-in classes with exactly those fields, so a wrong field name fails."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("rclpy", reason="rclpy (ROS 2 wheels) is installed by `make test`")

from builtin_interfaces.msg import Time  # noqa: E402
from std_msgs.msg import Header  # noqa: E402

from orin_vlm_node.engine.grounding import Detection  # noqa: E402
from orin_vlm_node.ros.detections import annotated, detection_array, detections_json  # noqa: E402
from orin_vlm_node.ros.image import PickedFrames  # noqa: E402


class _Fields:
    """A message stand-in: only the documented fields exist (a misspelt one raises AttributeError)."""

    __slots__ = ()


def _message(name: str, **fields):
    cls = type(name, (_Fields,), {"__slots__": tuple(fields)})

    def init(self):
        for key, make in fields.items():
            setattr(self, key, make())

    cls.__init__ = init
    return cls


Point2D = _message("Point2D", x=float, y=float)
Pose2D = _message("Pose2D", position=Point2D, theta=float)
BoundingBox2D = _message("BoundingBox2D", center=Pose2D, size_x=float, size_y=float)
ObjectHypothesis = _message("ObjectHypothesis", class_id=str, score=float)
ObjectHypothesisWithPose = _message("ObjectHypothesisWithPose", hypothesis=ObjectHypothesis, pose=object)
Detection2D = _message("Detection2D", header=Header, results=list, bbox=BoundingBox2D, id=str)
Detection2DArray = _message("Detection2DArray", header=Header, detections=list)
MSGS = SimpleNamespace(Detection2DArray=Detection2DArray, Detection2D=Detection2D,
                       ObjectHypothesisWithPose=ObjectHypothesisWithPose)  # fmt: skip

HEADERS = (
    Header(stamp=Time(sec=10, nanosec=5), frame_id="front"),
    Header(stamp=Time(sec=11, nanosec=7), frame_id="wrist"),
)
FRAMES = PickedFrames(
    images=(np.zeros((480, 640, 3), np.uint8), np.zeros((720, 1280, 3), np.uint8)),
    used=(("front/image", 10.0), ("wrist/image", 11.0)),
    headers=HEADERS,
)
FOUND = [
    Detection("red cup", (64.0, 120.0, 320.0, 480.0), 0, 0.8),
    Detection("person", (10.0, 20.0, 30.0, 60.0), 1, 0.5),
]


def test_the_detection_array_has_each_frame_s_header_and_boxes_centred_in_pixels():
    array = detection_array(FOUND, HEADERS, MSGS)
    assert array.header is HEADERS[0] and len(array.detections) == 2
    cup, person = array.detections
    assert cup.header is HEADERS[0] and person.header is HEADERS[1]
    assert (cup.bbox.center.position.x, cup.bbox.center.position.y) == (192.0, 300.0)
    assert (cup.bbox.size_x, cup.bbox.size_y) == (256.0, 360.0)
    (hypothesis,) = cup.results
    assert hypothesis.hypothesis.class_id == "red cup" and hypothesis.hypothesis.score == pytest.approx(0.8)
    assert cup.id == "red cup"


def test_detections_json_carries_the_stamps_frame_ids_topics_and_pixel_boxes():
    doc = json.loads(detections_json("req-3", ["red cup", "person"], FOUND, FRAMES))
    assert doc["request_id"] == "req-3" and doc["labels"] == ["red cup", "person"]
    assert doc["stamp"] == {"sec": 10, "nanosec": 5} and doc["frame_id"] == "front"
    person = doc["detections"][1]
    assert person["label"] == "person" and person["box"] == [10.0, 20.0, 30.0, 60.0] and person["image"] == 1
    assert person["topic"] == "wrist/image" and person["frame_id"] == "wrist"
    assert person["stamp"] == {"sec": 11, "nanosec": 7} and person["score"] == 0.5


def test_the_annotated_frame_draws_only_its_own_objects():
    drawn = annotated(FRAMES.images[0], FOUND, 0)
    assert drawn[120, 64:320].any() and not FRAMES.images[0].any()  # a copy, the box edge drawn
    assert not annotated(FRAMES.images[1], FOUND[:1], 1).any()
