"""One asker of the node: its topic and service names, its publishers and its conversation.

Why channels: a robot has several subsystems that ask (manipulation, navigation, an operator UI), and one
node per asker would load the model once each, on a Jetson that has memory for one. With
``channels: [arm, nav]`` each asker gets ``arm/prompt``, ``arm/tokens``, ``arm/response``, ``arm/status``
and the services ``~/arm/reset`` and ``~/arm/cancel``, its own conversation and its own queue, while all
share one engine (model and KV pool). Without ``channels`` the node has one channel named ``""`` on the
plain names (``prompt``, ``~/reset``, ...), as before channels existed.

Names are checked here (:func:`channel_names_problem`): letters, digits and ``_``, starting with a letter,
so that a name is valid inside a topic, a service and a parameter name (``arm.system_prompt``) alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from rclpy.qos import QoSProfile
from sensor_msgs.msg import Image
from std_msgs.msg import String

from ..engine.grounding import Detection
from .detections import annotated, detection_array, detections_json
from .image import PickedFrames, rgb_to_image_msg
from .token_stream import TokenStream

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


def channel_names_problem(names: Sequence[str]) -> str | None:
    """Why a ``channels`` entry cannot name a channel, or None."""
    for name in names:
        if not _NAME.fullmatch(name):
            return (
                f"channels entry {name!r} is not a channel name: letters, digits and _ only, starting with a "
                "letter (it becomes part of topic, service and parameter names)"
            )
    return None


class Channel:
    """A channel's names, publishers and conversation id; also the worker's
    :class:`~.worker.Outputs` for the channel's prompts.

    ``make_publisher(type, topic, qos)`` and ``destroy_publisher`` come from the node (a managed node makes
    lifecycle publishers); ``on_status(channel, event, request_id, fields)`` is the node's status
    publishing, which orders events and announces ``ready`` first; ``warn`` the node's log.
    """

    def __init__(
        self,
        name: str,
        make_publisher: Callable[[Any, str, QoSProfile | int], Any],
        stream_qos: QoSProfile,
        token_period_s: float,
        on_status: Callable[[Channel, str, str | None, dict[str, Any]], None],
        warn: Callable[[str], None],
        session_id: str,
        detection_msgs: Any = None,
        draw_detections: bool = False,
    ) -> None:
        self.name = name
        self.session_id = session_id
        self._on_status = on_status
        self._warn = warn
        self.tokens_pub = make_publisher(String, self.topic("tokens"), stream_qos)
        self.response_pub = make_publisher(String, self.topic("response"), 10)
        self.status_pub = make_publisher(String, self.topic("status"), stream_qos)
        self.token_stream = TokenStream(lambda text: self.tokens_pub.publish(String(data=text)), token_period_s)
        self.detections_json_pub = make_publisher(String, self.topic("detections_json"), 10)
        self._detection_msgs = detection_msgs  # vision_msgs' classes (None: not installed)
        self.detections_pub = (
            make_publisher(detection_msgs.Detection2DArray, self.topic("detections"), 10) if detection_msgs else None
        )
        self.detections_image_pub = (
            make_publisher(Image, self.topic("detections_image"), 2) if draw_detections else None
        )

    @property
    def publishers(self) -> tuple[Any, ...]:
        optional = (self.detections_pub, self.detections_image_pub)
        return (self.tokens_pub, self.response_pub, self.status_pub, self.detections_json_pub,
                *(p for p in optional if p is not None))  # fmt: skip

    def topic(self, leaf: str) -> str:
        """``leaf`` (prompt, tokens, ...) under the channel: relative, so namespaces and remaps apply."""
        return f"{self.name}/{leaf}" if self.name else leaf

    def service(self, leaf: str) -> str:
        """``~/leaf`` under the channel (private to the node)."""
        return f"~/{self.name}/{leaf}" if self.name else f"~/{leaf}"

    def label(self) -> str:
        return self.name or "default"

    # -- the worker's Outputs -----------------------------------------------------------------------
    def tokens(self, text: str) -> None:
        self.token_stream.push(text)

    def end_tokens(self) -> None:
        if not self.token_stream.flush():
            self._warn(f"channel {self.label()}: tokens of the last answer were still being published after 5 s")
        self.token_stream.start_answer()

    def response(self, text: str) -> None:
        self.response_pub.publish(String(data=text))

    def status(self, event: str, request_id: str | None, **fields: Any) -> None:
        self._on_status(self, event, request_id, fields)

    def detections(
        self, request_id: str, labels: Sequence[str], found: Sequence[Detection], frames: PickedFrames
    ) -> None:
        """A detection request's objects: JSON, vision_msgs where installed, the frames with boxes drawn."""
        self.detections_json_pub.publish(String(data=detections_json(request_id, labels, found, frames)))
        if self.detections_pub is not None:
            self.detections_pub.publish(detection_array(found, frames.headers, self._detection_msgs))
        if self.detections_image_pub is not None:
            for i, (rgb, header) in enumerate(zip(frames.images, frames.headers, strict=True)):
                msg = rgb_to_image_msg(annotated(rgb, found, i), Image, stamp=header.stamp, frame_id=header.frame_id)
                self.detections_image_pub.publish(msg)
