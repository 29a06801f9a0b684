"""A detection request's answer as messages: ``detections_json`` (always), ``vision_msgs/Detection2DArray`` where
vision_msgs is installed, and the frames with their boxes drawn for rviz / rqt_image_view.

Each object carries the header of the frame it was found in (stamp and frame_id as the camera sent them), so a
grasp pipeline can transform its box with the camera's calibration at the time of that frame. vision_msgs is
not on PyPI: it is declared for rosdep, imported when the node starts, and its absence logged once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import cv2
import numpy as np

from ..engine.grounding import Detection
from .image import PickedFrames


def vision_msgs() -> SimpleNamespace | None:
    """The vision_msgs message classes, or None where the package is not installed."""
    try:
        from vision_msgs.msg import Detection2D, Detection2DArray, ObjectHypothesisWithPose
    except ImportError:
        return None
    return SimpleNamespace(Detection2DArray=Detection2DArray, Detection2D=Detection2D,
                           ObjectHypothesisWithPose=ObjectHypothesisWithPose)  # fmt: skip


def _stamp(header: Any) -> dict[str, int] | None:
    return None if header is None else {"sec": int(header.stamp.sec), "nanosec": int(header.stamp.nanosec)}


def detections_json(request_id: str, labels: Sequence[str], found: Sequence[Detection], frames: PickedFrames) -> str:
    """The ``detections_json`` message: the first frame's stamp and frame_id, what was asked, and each object
    with its frame (index, topic, stamp, frame_id), label, pixel box and score."""
    headers = frames.headers or (None,) * len(frames.used)
    first = headers[0] if headers else None

    def one(d: Detection) -> dict[str, Any]:
        header = headers[d.image]
        return {**d.as_dict(), "topic": frames.used[d.image][0], "stamp": _stamp(header),
                "frame_id": header.frame_id if header is not None else None}  # fmt: skip

    return json.dumps(
        {"request_id": request_id, "stamp": _stamp(first), "frame_id": first.frame_id if first is not None else None,
         "labels": list(labels), "detections": [one(d) for d in found]},
        ensure_ascii=False,
    )  # fmt: skip


def detection_array(found: Sequence[Detection], headers: Sequence[Any], msgs: Any) -> Any:
    """A ``vision_msgs/Detection2DArray`` (``msgs``: the message classes): the first frame's header, and per
    object a ``Detection2D`` with its frame's header, a ``bbox`` centred on the box (pixels) and one
    hypothesis (``class_id`` the label, ``score``)."""
    array = msgs.Detection2DArray()
    if headers:
        array.header = headers[0]
    for d in found:
        detection = msgs.Detection2D()
        detection.header = headers[d.image]
        x1, y1, x2, y2 = d.box
        detection.bbox.center.position.x, detection.bbox.center.position.y = (x1 + x2) / 2, (y1 + y2) / 2
        detection.bbox.size_x, detection.bbox.size_y = x2 - x1, y2 - y1
        hypothesis = msgs.ObjectHypothesisWithPose()
        hypothesis.hypothesis.class_id, hypothesis.hypothesis.score = d.label, float(d.score)
        detection.results.append(hypothesis)
        detection.id = d.label
        array.detections.append(detection)
    return array


def annotated(rgb: np.ndarray, found: Sequence[Detection], image: int) -> np.ndarray:
    """A copy of frame ``image`` (RGB) with its objects' boxes and labels drawn."""
    out = np.ascontiguousarray(rgb).copy()
    for d in (d for d in found if d.image == image):
        x1, y1, x2, y2 = (int(round(v)) for v in d.box)
        cv2.rectangle(out, (x1, y1), (x2, y2), (255, 0, 0), 2)
        cv2.putText(out, f"{d.label} {d.score:.2f}", (x1, max(y1 - 4, 12)), cv2.FONT_HERSHEY_SIMPLEX, 0.5,
                    (255, 0, 0), 1, cv2.LINE_AA)  # fmt: skip
    return out
