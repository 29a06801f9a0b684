"""Several cameras (``image_topics``): a prompt looks at the latest frame of each listed topic, in the
listed order, and its status says which frames it used and which cameras it could not.

A node process with ``image_topics: [front, wrist]`` over real DDS; its answers are compared with the
engine run in this process on the same images in the same order (random weights: noise text, compared,
never hard-coded).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytest.importorskip("rclpy", reason="rclpy (ROS 2 wheels) is installed by `make test`")

import cv2  # noqa: E402
from builtin_interfaces.msg import Time  # noqa: E402
from ros_harness import FAST_PARAMS, running_node  # noqa: E402
from sensor_msgs.msg import CompressedImage, Image  # noqa: E402

from orin_vlm_node.engine import Engine, Finished, Request, Turn  # noqa: E402
from orin_vlm_node.ros.image import rgb_to_image_msg  # noqa: E402
from orin_vlm_node.ros.params import defaults, engine_config, sampling_params  # noqa: E402
from support.checkpoints import cached_tiny_checkpoint  # noqa: E402

QUESTION = "What do the two cameras see?"
FRONT = np.random.default_rng(1).integers(0, 256, size=(64, 96, 3), dtype=np.uint8)
WRIST = np.random.default_rng(2).integers(0, 256, size=(80, 48, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def values():
    params = {**FAST_PARAMS, "device": "cpu", "image_topics": ["front", "wrist"], "image_max_age_s": 3.0}
    return {**defaults(), **params, "model_path": str(cached_tiny_checkpoint())}


@pytest.fixture(scope="module")
def vlm(values, tmp_path_factory):
    with running_node(values, tmp_path_factory.mktemp("node"), __name__) as (node, client):
        front = client.node.create_publisher(Image, "front", 10)
        wrist = client.node.create_publisher(CompressedImage, "wrist/compressed", 10)
        yield client, front, wrist


@pytest.fixture(scope="module")
def reference(values):
    torch.set_num_threads(1)  # like the node (ros_harness): same reduction order, same greedy tokens
    engine = Engine(engine_config(values))

    def answer(images: tuple[np.ndarray, ...]) -> str:
        request = Request(turn=Turn(text=QUESTION, images=images), sampling=sampling_params(values))
        final = list(engine.generate(request))[-1]
        assert isinstance(final, Finished) and final.finish_reason in ("stop", "length"), final
        return final.text

    return answer


def _publish(publisher, msg) -> None:
    for _ in range(3):  # the first copies may go out before the subscription matched
        publisher.publish(msg)
        time.sleep(0.05)
    time.sleep(0.2)


def _png(rgb: np.ndarray, sec: int) -> CompressedImage:
    ok, png = cv2.imencode(".png", rgb[:, :, ::-1])
    assert ok
    msg = CompressedImage(format="png")  # lossless: the node decodes the same pixels
    msg.header.stamp = Time(sec=sec, nanosec=0)
    msg.data = png.tobytes()
    return msg


def test_a_prompt_sees_every_camera_in_the_listed_order(vlm, reference):
    client, front, wrist = vlm
    _publish(wrist, _png(WRIST, 20))  # arrival order is not prompt order
    _publish(front, rgb_to_image_msg(FRONT, Image, stamp=Time(sec=10, nanosec=0)))
    result = client.ask(QUESTION)
    final = result["status"]
    assert final["images"] == [{"topic": "front", "stamp": 10.0}, {"topic": "wrist", "stamp": 20.0}]
    assert final["image_stamp"] == 10.0 and final["note"] is None
    assert result["events"][0]["images"] == final["images"]  # accepted says it already
    assert result["response"] == reference((FRONT, WRIST))
    assert result["response"] != reference((WRIST, FRONT)), "the order of the images must matter"


def test_a_silent_camera_is_named_and_the_prompt_answered_without_it(vlm, reference):
    client, front, _ = vlm
    time.sleep(3.2)  # both frames of the previous test are too old now
    _publish(front, rgb_to_image_msg(FRONT, Image, stamp=Time(sec=30, nanosec=0)))
    result = client.ask(QUESTION)
    final = result["status"]
    assert final["images"] == [{"topic": "front", "stamp": 30.0}]
    assert final["note"].startswith("wrist: image ignored: received") and "image_max_age_s=3" in final["note"]
    assert result["response"] == reference((FRONT,))
