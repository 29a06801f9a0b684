"""Output formats through the node: a channel's ``output_format`` parameter constrains its plain prompts, a
``prompt_json`` message carries its own, the status events say which format was used and what came of it,
and a format that cannot work is refused when set or sent, the node serving on. A detection request is
published as detections with the camera frame's header, and drawn. Answers are compared with the
engine run in this process on the same request (random weights: never with hard-coded strings)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("rclpy", reason="rclpy (ROS 2 wheels) is installed by `make test`")

from ros_harness import FAST_PARAMS, running_node  # noqa: E402

from orin_vlm_node.engine import Engine, Finished, Request, Turn, output_format  # noqa: E402
from orin_vlm_node.ros.params import defaults, engine_config, sampling_params  # noqa: E402
from support.checkpoints import cached_tiny_checkpoint  # noqa: E402

CHOICE = {"choice": ["open", "closed"]}
SCHEMA = {
    "type": "object",
    "properties": {"door": {"enum": ["open", "closed"]}, "people": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["door", "people"],
    "additionalProperties": False,
}
PARAMS = {**FAST_PARAMS, "device": "cpu", "max_new_tokens": 200, "output_format": "", "detections_image": True}


@pytest.fixture(scope="module")
def values():
    return {**defaults(), **PARAMS, "model_path": str(cached_tiny_checkpoint())}


@pytest.fixture(scope="module")
def vlm(values, tmp_path_factory):
    with running_node(values, tmp_path_factory.mktemp("node"), __name__) as (_, client):
        yield client


@pytest.fixture(scope="module")
def reference(values):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(engine_config(values))

    def answer(text: str, kind: str, spec, images=(), token_probs=False) -> Finished:
        fmt = spec if kind is None else output_format(kind, spec)
        request = Request(Turn(text, images), sampling_params(values), output=fmt, token_probs=token_probs)
        return list(engine.generate(request))[-1]

    answer.engine = engine
    yield answer
    torch.set_num_threads(threads)


def test_the_channel_s_format_constrains_a_plain_prompt(vlm, reference):
    (result,) = vlm.set_params({"output_format": json.dumps(CHOICE)})
    assert result.successful, result.reason
    try:
        answer = vlm.ask("Is the door open?")
    finally:
        vlm.set_params({"output_format": ""})
    want = reference("Is the door open?", "choice", CHOICE["choice"])
    assert answer["response"] == want.text and want.text in CHOICE["choice"]
    final = answer["status"]
    assert final["event"] == "finished" and final["output"] == want.output
    assert all(e["output_format"] == "choice of 2: open | closed" for e in answer["events"])


def test_a_prompt_json_message_carries_its_own_format_and_plain_prompts_stay_free(vlm, reference):
    answer = vlm.ask({"prompt": "Describe the doorway.", "output": {"json_schema": SCHEMA}})
    want = reference("Describe the doorway.", "json_schema", SCHEMA)
    assert answer["response"] == want.text
    final = answer["status"]
    assert final["output"] == {"format": "json_schema", "complete": True, "value": json.loads(want.text)}
    plain = vlm.ask('{"prompt": "this is a plain prompt that looks like JSON"}')
    assert plain["status"]["output"] is None and plain["status"]["output_format"] is None


@pytest.mark.parametrize(
    "message, reason",
    [
        ("not json", "prompt_json message is not valid JSON"),
        ({"text": "hi"}, "unknown keys text"),
        ({"prompt": 3}, 'must hold a "prompt" string'),
        ({"prompt": "hi", "detect": "cup"}, 'must hold a "prompt" string'),
        ({"detect": "cup"}, "a detection request needs a camera frame: none from image ("),
        ({"detect": ", ".join(f"thing {i}" for i in range(21))}, "names 21 labels; at most 20 (detect_max_labels)"),
        ({"prompt": "hi", "format": {}}, "unknown keys format"),
        ({"prompt": "hi", "output": {"regex": "(["}}, "invalid regex"),
        ({"prompt": "hi", "output": {"choice": []}}, "choice needs a list of non-empty strings"),
    ],
)
def test_a_prompt_json_message_that_cannot_work_is_an_error_event(vlm, message, reason):
    if isinstance(message, str):
        vlm.prompt_json_pub.publish(vlm._string(data=message))
        event = vlm.wait_for(
            lambda: next((e for e in reversed(vlm.status) if e["event"] == "error"), None), 30, "error"
        )
    else:
        event = vlm.ask(message)["status"]
    assert event["event"] == "error" and reason in event["error"]
    assert vlm.ask("Still there?")["status"]["event"] == "finished"


@pytest.mark.parametrize(
    "value, reason",
    [
        ('{"regex": "(["}', "invalid regex"),
        ('{"choice": "yes"}', "choice needs a list of non-empty strings"),
        ('{"regex": "a", "choice": ["b"]}', "output format names one of json_schema, regex, choice"),
        ("yes|no", "output format is not valid JSON"),
    ],
)
def test_an_output_format_parameter_that_cannot_work_is_refused_with_a_reason(vlm, value, reason):
    (result,) = vlm.set_params({"output_format": value})
    assert not result.successful and reason in result.reason
    assert vlm.get_params(["output_format"]) == {"output_format": ""}


def test_a_detection_request_is_published_with_the_frame_s_header_and_drawn(vlm, reference):
    """Last in this module: its camera frame stays fresh for what would follow."""
    from builtin_interfaces.msg import Time
    from sensor_msgs.msg import Image
    from std_msgs.msg import String

    from orin_vlm_node.engine.grounding import detections, grounding_request
    from orin_vlm_node.ros.image import rgb_to_image_msg

    received: dict[str, list] = {"json": [], "image": []}
    vlm.node.create_subscription(String, "detections_json", lambda m: received["json"].append(m.data), 10)
    vlm.node.create_subscription(Image, "detections_image", received["image"].append, 10)
    rgb = np.random.default_rng(3).integers(0, 256, (72, 96, 3), dtype=np.uint8)
    vlm.publish_image(rgb_to_image_msg(rgb, Image, stamp=Time(sec=77, nanosec=123), frame_id="front_camera"))
    answer = vlm.ask({"detect": "red cup, person"})
    assert answer["status"]["event"] == "finished", answer["status"]
    vlm.wait_for(lambda: received["json"] and received["image"], 10, "the detections")
    doc = json.loads(received["json"][0])
    assert doc["stamp"] == {"sec": 77, "nanosec": 123} and doc["frame_id"] == "front_camera"
    assert doc["labels"] == ["red cup", "person"]
    text, fmt = grounding_request(("red cup", "person"), 1)
    want = reference(text, None, fmt, images=(rgb,), token_probs=True)
    assert answer["response"] == want.text
    found = detections(want.text, want.token_probs, want.token_spans, [rgb.shape[:2]])
    assert [(d["label"], d["box"], d["image"]) for d in doc["detections"]] == [(d.label, list(d.box), 0) for d in found]
    assert [d["score"] for d in doc["detections"]] == pytest.approx([d.score for d in found], rel=1e-4)
    drawn = received["image"][0]
    assert drawn.header.frame_id == "front_camera" and (drawn.width, drawn.height) == (96, 72)
