"""The managed (lifecycle) variant of the node, ``vlm_lifecycle_node``: a supervisor decides when the model
loads and when the node serves.

Why: on a robot, a lifecycle manager (nav2's, or a system's own) brings nodes up in order and takes them
down when the robot parks or changes task; the model's memory (the robot's RAM on a Jetson) should be
held only between ``configure`` and ``cleanup``. The transitions map onto the steps of
:class:`~.node.VlmServing`:

More in docs/modules.md, ``orin_vlm_node/ros/lifecycle_node.py``.
"""

from __future__ import annotations

from typing import Any

from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.qos import QoSProfile

from ..engine import EngineError
from .names import NODE_NAME
from .node import VlmServing
from .startup import StartupError

DEACTIVATE_TIMEOUT_S = 5.0


class VlmLifecycleNode(VlmServing, LifecycleNode):
    """``orin_vlm`` as a managed node; construction only declares the parameters."""

    def __init__(self, **node_kwargs: Any) -> None:
        LifecycleNode.__init__(self, NODE_NAME, **node_kwargs)
        self._declare()
        self._load_s = 0.0
        self._active = False
        self._shutdown_reason = "node shutting down"

    def _make_publisher(self, msg_type: Any, topic: str, qos: QoSProfile | int) -> Any:
        return self.create_lifecycle_publisher(msg_type, topic, qos)

    def _destroy_publisher(self, publisher: Any) -> None:
        self.destroy_lifecycle_publisher(publisher)

    @property
    def loaded(self) -> bool:
        return self._engine is not None

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            self._load_s = self._load()
        except (StartupError, EngineError, ValueError) as exc:
            self.get_logger().error(f"configure failed: {exc}")
            return TransitionCallbackReturn.FAILURE
        self.get_logger().info(f"configured: model loaded in {self._load_s:.1f} s; activate to serve")
        return super().on_configure(state)

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        result = super().on_activate(state)  # enables the publishers
        if result == TransitionCallbackReturn.SUCCESS:
            self._open(self._load_s)
            self._active = True
        return result

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop_serving("node deactivated")
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._unload()
        self.get_logger().info("cleaned up: model freed")
        return super().on_cleanup(state)

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop_serving(self._shutdown_reason)
        if self.loaded:
            self._unload()
        self.finished = True  # the process may exit
        return super().on_shutdown(state)

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        """A transition raised: give everything back; the node returns to unconfigured."""
        self._stop_serving("node error")
        if self.loaded:
            self._unload()
        return TransitionCallbackReturn.SUCCESS

    def _stop_serving(self, why: str) -> None:
        if self._active:
            self._active = False
            self._close(why, DEACTIVATE_TIMEOUT_S)

    def shutdown(self, why: str) -> None:
        """Stop by signal (``main``): the ``shutdown`` transition from whatever state the node is in."""
        if not self.finished:
            self._shutdown_reason = why
            self.trigger_shutdown()
