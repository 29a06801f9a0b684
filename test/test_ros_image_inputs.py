"""Image subscriptions matched to their publishers' reliability, and the warning for a topic whose publishers
deliver nothing; on a stand-in for the node (the DDS behaviour itself is covered end to end in
test_node_hostile_input)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("rclpy", reason="rclpy (ROS 2 wheels) is installed by `make test`")

from rclpy.qos import ReliabilityPolicy  # noqa: E402

from orin_vlm_node.ros import image_inputs  # noqa: E402
from orin_vlm_node.ros.image_inputs import ImageInputs, choose_reliability  # noqa: E402

RELIABLE, BEST_EFFORT = ReliabilityPolicy.RELIABLE, ReliabilityPolicy.BEST_EFFORT


@pytest.mark.parametrize(
    ("setting", "publishers", "expected"),
    [
        ("auto", [], BEST_EFFORT),
        ("auto", [RELIABLE], RELIABLE),
        ("auto", [RELIABLE, RELIABLE], RELIABLE),
        ("auto", [RELIABLE, BEST_EFFORT], BEST_EFFORT),
        ("reliable", [BEST_EFFORT], RELIABLE),
        ("best_effort", [RELIABLE], BEST_EFFORT),
    ],
)
def test_reliability_follows_the_publishers(setting, publishers, expected):
    assert choose_reliability(setting, publishers) == expected


class FakeNode:
    """The few node calls ImageInputs makes, recorded."""

    def __init__(self) -> None:
        self.publishers: dict[str, list] = {}
        self.subscriptions: list[SimpleNamespace] = []
        self.warnings: list[str] = []
        self.infos: list[str] = []

    def create_subscription(self, msg_type, topic, callback, qos):
        sub = SimpleNamespace(topic_name=f"/{topic}", qos=qos, callback=callback, alive=True)
        self.subscriptions.append(sub)
        return sub

    def destroy_subscription(self, sub) -> None:
        sub.alive = False

    def create_timer(self, period, callback):
        return SimpleNamespace(period=period, callback=callback)

    def get_publishers_info_by_topic(self, topic):
        return [SimpleNamespace(qos_profile=SimpleNamespace(reliability=r)) for r in self.publishers.get(topic, [])]

    def get_logger(self):
        return SimpleNamespace(warning=self.warnings.append, info=self.infos.append)


def live(node: FakeNode) -> list[SimpleNamespace]:
    return [s for s in node.subscriptions if s.alive]


def test_the_subscription_follows_the_publishers_and_a_silent_topic_is_named_once(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(image_inputs.time, "monotonic", lambda: clock[0])
    node, frames = FakeNode(), []
    inputs = ImageInputs(node, "auto", [("image", object, frames.append)])
    (sub,) = live(node)
    assert sub.qos.reliability == BEST_EFFORT  # nobody publishes yet: compatible with every publisher
    node.publishers["/image"] = [RELIABLE]
    inputs.check()
    (sub,) = live(node)
    assert sub.qos.reliability == RELIABLE and "now reliable" in node.infos[-1]
    clock[0] += image_inputs.SILENT_AFTER_S + 1
    inputs.check()
    inputs.check()
    assert len(node.warnings) == 1 and "/image has 1 publisher(s) (reliable) but no frame arrived" in node.warnings[0]
    sub.callback("frame")  # frames arrive again: the warning re-arms
    assert frames == ["frame"]
    clock[0] += image_inputs.SILENT_AFTER_S + 1
    inputs.check()
    assert len(node.warnings) == 2
    node.publishers["/image"] = [RELIABLE, BEST_EFFORT]  # a best-effort camera joins: reliable would not hear it
    inputs.check()
    (sub,) = live(node)
    assert sub.qos.reliability == BEST_EFFORT
