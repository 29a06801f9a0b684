"""Video prompts over real DDS: the node keeps each camera's recent frames by their header stamps, and a
prompt on ``prompt_json`` with ``"video"`` gets them as Qwen3-VL video input; its answer is compared with the
engine run in this process on the same frames and times (random weights: compared, never hard-coded)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytest.importorskip("rclpy", reason="rclpy (ROS 2 wheels) is installed by `make test`")

from builtin_interfaces.msg import Time  # noqa: E402
from ros_harness import FAST_PARAMS, running_node  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402

from orin_vlm_node.engine import Engine, Finished, Request, Turn, Video  # noqa: E402
from orin_vlm_node.ros.image import rgb_to_image_msg  # noqa: E402
from orin_vlm_node.ros.params import defaults, engine_config, sampling_params  # noqa: E402
from support.checkpoints import cached_tiny_checkpoint  # noqa: E402

QUESTION = "Which way did the square move?"
STAMPS = [10.0, 10.2, 10.5, 11.0, 11.5, 12.0, 12.5]  # 10.2 comes too soon after 10.0 at 2 frames a second


def _frame(i: int) -> np.ndarray:
    frame = np.full((48, 64, 3), 200, np.uint8)
    frame[16:32, 4 + 6 * i : 20 + 6 * i] = (220, 30, 30)
    return frame


@pytest.fixture(scope="module")
def values():
    params = {**FAST_PARAMS, "device": "cpu", "image_topics": ["front"], "image_reliability": "best_effort",
              "video_history_fps": 2.0}  # fmt: skip
    return {**defaults(), **params, "model_path": str(cached_tiny_checkpoint())}


@pytest.fixture(scope="module")
def vlm(values, tmp_path_factory):
    with running_node(values, tmp_path_factory.mktemp("node"), __name__) as (_, client):
        yield client, client.node.create_publisher(Image, "front", 10)


def _reference(values, frames: list[np.ndarray], times: list[float]) -> str:
    torch.set_num_threads(1)  # like the node: same reduction order, same greedy tokens
    engine = Engine(engine_config(values))
    turn = Turn(QUESTION, videos=(Video(tuple(frames), tuple(times)),))
    final = list(engine.generate(Request(turn, sampling_params(values))))[-1]
    assert isinstance(final, Finished) and final.finish_reason in ("stop", "length"), final
    return final.text


def test_a_video_prompt_before_any_frame_is_an_error_naming_the_camera(vlm):
    client, _ = vlm
    result = client.ask({"prompt": QUESTION, "video": 2})
    assert result["status"]["event"] == "error"
    assert "no frame from front in the video history yet" in result["status"]["error"]


def test_a_video_prompt_gets_the_last_seconds_timed_by_the_stamps(vlm, values):
    client, front = vlm
    client.wait_for(lambda: front.get_subscription_count() > 0, 30.0, "the node's front subscription")
    for i, stamp in enumerate(STAMPS):
        front.publish(rgb_to_image_msg(_frame(i), Image, stamp=Time(sec=int(stamp), nanosec=int(stamp % 1 * 1e9))))
        time.sleep(0.1)
    time.sleep(0.5)
    result = client.ask({"prompt": QUESTION, "video": {"seconds": 2, "fps": 2}})
    final = result["status"]
    assert final["event"] == "finished", final
    # 10.5 .. 12.5, less 10.5: the first frame of a pair is at an even place of the camera's frames kept
    assert final["videos"] == [{"topic": "front", "frames": 4, "first_stamp": 11.0, "last_stamp": 12.5}]
    assert final["images"] == [] and final["note"] is None
    assert final["metrics"]["video_frames"] == 4.0 and final["metrics"]["video_tokens"] > 0
    assert result["events"][0]["videos"] == final["videos"]  # accepted says it already
    frames = [_frame(i) for i in (3, 4, 5, 6)]
    assert result["response"] == _reference(values, frames, [0.0, 0.5, 1.0, 1.5])
    # at one frame a second: every other frame, and a span longer than kept is said
    longer = client.ask({"prompt": QUESTION, "video": {"seconds": 30, "fps": 1}})["status"]
    assert longer["videos"] == [{"topic": "front", "frames": 3, "first_stamp": 10.5, "last_stamp": 12.5}]
    assert "front: 2.5 s of history kept, 30 s asked" in longer["note"]
