"""Channels: several askers served by one node (one model, one KV pool), each on its own topics and
services, with its own settings, queue and conversation; prompts of different channels decode together.

A node process with ``channels: [arm, nav]`` over real DDS. ``arm`` answers at most 3 tokens
(``arm.max_new_tokens``), ``nav`` has its own system prompt (``nav.system_prompt``); answers are compared
with the engine run in this process on the same inputs (random weights: noise text, compared, never
hard-coded).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("rclpy", reason="rclpy (ROS 2 wheels) is installed by `make test`")

from ros_harness import FAST_PARAMS, running_node  # noqa: E402

from orin_vlm_node.engine import Engine, Finished, Request, Turn  # noqa: E402
from orin_vlm_node.ros.params import channel_values, defaults, engine_config, sampling_params  # noqa: E402
from support.checkpoints import cached_tiny_checkpoint  # noqa: E402
from support.node_client import VlmClient  # noqa: E402

# Without an image the tiny checkpoint's greedy answer runs to max_new_tokens (see test_node_integration).
QUESTION = "Describe this image."
NAV_SYSTEM = "You steer a wheeled robot. Answer briefly."


@pytest.fixture(scope="module")
def values():
    params = {**FAST_PARAMS, "device": "cpu", "channels": ["arm", "nav"], "arm.max_new_tokens": 3,
              "nav.system_prompt": NAV_SYSTEM, "max_queue": 4}  # fmt: skip
    return {**defaults(), **params, "model_path": str(cached_tiny_checkpoint())}


@pytest.fixture(scope="module")
def vlm(values, tmp_path_factory):
    with running_node(values, tmp_path_factory.mktemp("node"), __name__) as (node, arm):
        nav = VlmClient(node.domain_id, channel="nav")
        try:
            nav.wait_until_connected(node)
            yield node, arm, nav
        finally:
            nav.close()


@pytest.fixture(scope="module")
def reference(values):
    torch.set_num_threads(1)  # like the node (ros_harness): same reduction order, same greedy tokens
    engine = Engine(engine_config({**values, "multi_turn": True}))  # room for sessions

    def answer(channel: str, text: str, session_id: str | None = None, **overrides) -> Finished:
        scoped = channel_values({**values, **overrides}, channel)
        request = Request(turn=Turn(text=text), sampling=sampling_params(scoped),
                          system_prompt=scoped["system_prompt"] or None, session_id=session_id)  # fmt: skip
        final = list(engine.generate(request))[-1]
        assert isinstance(final, Finished) and final.finish_reason in ("stop", "length"), final
        return final

    answer.engine = engine
    return answer


def test_a_channel_listened_to_late_still_gets_ready_as_its_first_event(vlm):
    """``nav``'s client subscribes only once ``arm``'s has its ``ready`` (the fixture): ``nav``'s waited for it
    (the node used to announce every channel at most 3 s after loading, to nobody on a channel not yet
    listened to, and the volatile event was gone)."""
    _, arm, nav = vlm
    nav.wait_for(lambda: nav.events(event="ready"), 30, "nav's ready")
    for client in (arm, nav):
        assert client.status[0]["event"] == "ready", client.status[:3]
        assert len(client.events(event="ready")) == 1
        assert client.status[0]["note"].startswith("kernels: off (cpu device)")


def test_each_channel_answers_on_its_own_topics_with_its_own_settings(vlm, reference):
    _, arm, nav = vlm
    nav_before = len(nav.status)
    got = arm.ask(QUESTION)
    assert got["status"]["metrics"]["generated_tokens"] == 3  # arm.max_new_tokens
    assert got["response"] == reference("arm", QUESTION).text
    assert "".join(got["tokens"]) == got["response"]
    assert got["request_id"].startswith("arm-")
    assert not [e for e in nav.status[nav_before:] if e["request_id"] == got["request_id"]], "arm's events on nav"

    arm_responses = len(arm.responses)
    got = nav.ask(QUESTION)
    assert got["status"]["metrics"]["generated_tokens"] == FAST_PARAMS["max_new_tokens"]  # the node-wide value
    assert got["response"] == reference("nav", QUESTION).text  # nav's system prompt
    assert got["response"] != reference("arm", QUESTION, **{"arm.max_new_tokens": None}).text
    assert len(arm.responses) == arm_responses, "nav's answer reached arm"


def test_channels_asking_at_once_decode_together_and_get_their_answers_alone(vlm, reference):
    _, arm, nav = vlm
    long = {"nav.max_new_tokens": 300}  # nav still answers when arm's prompt arrives
    assert all(r.successful for r in nav.set_params(long))
    try:
        arm_before, nav_before = len(arm.status), len(nav.status)
        nav.send_prompt(QUESTION)
        nav.wait_for(lambda: [e for e in nav.status[nav_before:] if e["event"] == "started"], 30, "nav started")
        arm.send_prompt("What is ahead?")
        arm_end = arm.wait_for(lambda: [e for e in arm.status[arm_before:] if e["event"] == "finished"], 60, "arm")
        nav_end = nav.wait_for(lambda: [e for e in nav.status[nav_before:] if e["event"] == "finished"], 60, "nav")
    finally:
        assert all(r.successful for r in nav.set_params({"nav.max_new_tokens": 12}))
    assert arm_end[0]["metrics"]["batch_size"] == nav_end[0]["metrics"]["batch_size"] == 2
    assert arm.responses[-1] == reference("arm", "What is ahead?").text
    assert nav.responses[-1] == reference("nav", QUESTION, **long).text


def test_cancel_on_one_channel_leaves_the_other_running(vlm):
    _, arm, nav = vlm
    assert all(r.successful for r in nav.set_params({"nav.max_new_tokens": 4000, "arm.max_new_tokens": 4000}))
    try:
        nav_before, arm_before, arm_tokens = len(nav.status), len(arm.status), len(arm.tokens)
        nav.send_prompt(QUESTION)
        nav.wait_for(lambda: [e for e in nav.status[nav_before:] if e["event"] == "started"], 30, "nav started")
        arm.send_prompt(QUESTION)  # answered beside nav's, not after it
        arm.send_prompt(QUESTION)  # waits for arm's first answer
        started = arm.wait_for(
            lambda: [e for e in arm.status[arm_before:] if e["event"] == "started"], 30, "arm started"
        )
        arm.wait_for(lambda: len(arm.tokens) > arm_tokens, 30, "arm's first tokens")  # decoding beside nav

        reply = arm.trigger("cancel")
        assert reply.success and started[0]["request_id"] in reply.message and "dropped 1" in reply.message
        end = arm.wait_for(lambda: [e for e in arm.status[arm_before:] if e["event"] == "finished"], 30, "arm end")
        assert end[0]["finish_reason"] == "cancelled" and end[0]["metrics"]["batch_size"] == 2
        assert not [e for e in nav.status[nav_before:] if e["event"] in ("finished", "dropped", "error")]

        reply = nav.trigger("cancel")
        assert reply.success and "dropped 0" in reply.message
        end = nav.wait_for(
            lambda: [e for e in nav.status[nav_before:] if e["event"] == "finished"], 30, "nav's answer to end"
        )
        assert end[0]["finish_reason"] == "cancelled"
    finally:
        assert all(r.successful for r in nav.set_params({"nav.max_new_tokens": 12, "arm.max_new_tokens": 3}))


def test_each_channel_keeps_its_own_conversation(vlm, reference):
    _, arm, nav = vlm
    assert all(r.successful for r in arm.set_params({"multi_turn": True}))
    try:
        first = arm.ask(QUESTION)["response"]
        other = nav.ask("What is ahead?")["response"]
        second = arm.ask("And then?")["response"]
        assert first == reference("arm", QUESTION, "ref-arm").text
        assert other == reference("nav", "What is ahead?", "ref-nav").text  # not arm's conversation
        assert second == reference("arm", "And then?", "ref-arm").text  # arm's history, without nav's turn

        assert arm.trigger("reset").success  # arm forgets; nav goes on
        assert arm.ask(QUESTION)["response"] == first
        assert nav.ask("And then?")["response"] == reference("nav", "And then?", "ref-nav").text
    finally:
        assert all(r.successful for r in arm.set_params({"multi_turn": False}))
        reference.engine.reset()


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        ("arm.max_new_tokens", 0, "arm.max_new_tokens"),
        ("nav.image_topics", ["front"], "read-only"),
        ("arm.top_k", 3, "undeclared"),  # only the overridable settings exist per channel
    ],
)
def test_bad_channel_parameters_are_refused_with_a_reason(vlm, name, value, reason):
    _, arm, _ = vlm
    (result,) = arm.set_params({name: value})
    assert not result.successful and reason in result.reason, result.reason
