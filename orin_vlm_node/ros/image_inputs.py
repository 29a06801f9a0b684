"""The image subscriptions: reliability that matches the publishers, and a warning when frames stop arriving.

Why not always best effort (the sensor-data profile): a raw 1280x720 rgb8 frame is 2.7 MB, sent as
hundreds of fragments; a best-effort reader never asks for a lost fragment again, so from a reliable
publisher such frames may never arrive whole, with no error anywhere. A reliable reader gets them, but
cannot connect to a best-effort publisher at all (incompatible QoS). So ``image_reliability=auto``
(the default) subscribes reliable exactly when every publisher on the topic is reliable, and checks
again every :data:`CHECK_PERIOD_S`, re-creating the subscription when the publishers change.
``reliable`` and ``best_effort`` fix the choice. Either way a topic that has publishers but delivers no
frame for :data:`SILENT_AFTER_S` is named in the log once, until frames arrive again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

CHECK_PERIOD_S = 1.0
SILENT_AFTER_S = 10.0


def choose_reliability(setting: str, publishers: Sequence[ReliabilityPolicy]) -> ReliabilityPolicy:
    """The reliability to subscribe with, given ``image_reliability`` and the publishers' reliabilities."""
    if setting == "reliable":
        return ReliabilityPolicy.RELIABLE
    if setting == "best_effort":
        return ReliabilityPolicy.BEST_EFFORT
    reliable = bool(publishers) and all(p == ReliabilityPolicy.RELIABLE for p in publishers)
    return ReliabilityPolicy.RELIABLE if reliable else ReliabilityPolicy.BEST_EFFORT


def image_qos(reliability: ReliabilityPolicy) -> QoSProfile:
    """Only the newest frame matters: keep two, volatile, with the chosen reliability."""
    return QoSProfile(
        history=HistoryPolicy.KEEP_LAST, depth=2, reliability=reliability, durability=DurabilityPolicy.VOLATILE
    )


@dataclass
class _Input:
    topic: str
    msg_type: Any
    callback: Callable[[Any], None]
    subscription: Any = None
    reliability: ReliabilityPolicy | None = None
    last_frame: float = 0.0  # time.monotonic() of the last frame (or of the start)
    silent_since: float | None = None  # when the current publishers were first seen
    warned: bool = False


class ImageInputs:
    """The node's image subscriptions (raw and compressed), kept matched to their publishers."""

    def __init__(self, node: Any, setting: str, inputs: Sequence[tuple[str, Any, Callable[[Any], None]]]):
        self._node = node
        self._setting = setting
        start = time.monotonic()
        self._inputs = [_Input(topic, msg_type, callback, last_frame=start) for topic, msg_type, callback in inputs]
        for item in self._inputs:
            self._subscribe(item, choose_reliability(setting, []))
        self._timer = node.create_timer(CHECK_PERIOD_S, self.check)

    def _subscribe(self, item: _Input, reliability: ReliabilityPolicy) -> None:
        if item.subscription is not None:
            self._node.destroy_subscription(item.subscription)

        def on_frame(msg: Any, item: _Input = item) -> None:
            item.last_frame, item.warned = time.monotonic(), False
            item.callback(msg)

        item.subscription = self._node.create_subscription(item.msg_type, item.topic, on_frame, image_qos(reliability))
        item.reliability = reliability

    def close(self) -> None:
        """Unsubscribe every topic and stop checking (the node stops serving)."""
        self._node.destroy_timer(self._timer)
        for item in self._inputs:
            self._node.destroy_subscription(item.subscription)
            item.subscription = None

    def check(self) -> None:
        """Match each subscription to its publishers; name topics whose publishers deliver nothing."""
        now = time.monotonic()
        for item in self._inputs:
            topic = item.subscription.topic_name
            publishers = [info.qos_profile.reliability for info in self._node.get_publishers_info_by_topic(topic)]
            wanted = choose_reliability(self._setting, publishers)
            if wanted != item.reliability:
                self._subscribe(item, wanted)
                self._node.get_logger().info(
                    f"image subscription {topic}: now {wanted.name.lower()} ({len(publishers)} publisher(s), "
                    f"image_reliability={self._setting})"
                )
            self._watch_silence(item, topic, publishers, now)

    def _watch_silence(self, item: _Input, topic: str, publishers: list[ReliabilityPolicy], now: float) -> None:
        if not publishers:
            item.silent_since = None
            return
        if item.silent_since is None:
            item.silent_since = max(now, item.last_frame)
        quiet = now - max(item.silent_since, item.last_frame)
        if quiet >= SILENT_AFTER_S and not item.warned:
            item.warned = True
            kinds = ", ".join(sorted({p.name.lower() for p in publishers}))
            self._node.get_logger().warning(
                f"image topic {topic} has {len(publishers)} publisher(s) ({kinds}) but no frame arrived in "
                f"{quiet:.0f} s; subscribed {item.reliability.name.lower()} (image_reliability={self._setting})"
            )
