"""Output formats through the node: a channel's ``output_format`` parameter constrains its plain prompts, a
``prompt_json`` message carries its own, the status events say which format was used and what came of it,
and a format that cannot work is refused when set or sent, the node serving on. Answers are compared with the
engine run in this process on the same request (random weights: never with hard-coded strings)."""

from __future__ import annotations

import json

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
PARAMS = {**FAST_PARAMS, "device": "cpu", "max_new_tokens": 32, "image_max_age_s": 0.0, "output_format": ""}


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

    def answer(text: str, kind: str, spec) -> Finished:
        request = Request(Turn(text), sampling_params(values), output=output_format(kind, spec))
        return list(engine.generate(request))[-1]

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
        ("not json", "prompt_json message is not JSON"),
        ({"text": "hi"}, 'must be a JSON object with a "prompt" string'),
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
