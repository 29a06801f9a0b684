"""The managed (lifecycle) variant of the node, ``vlm_lifecycle_node``: a supervisor decides when the model
loads and when the node serves.

Why: on a robot, a lifecycle manager (nav2's, or a system's own) brings nodes up in order and takes them
down when the robot parks or changes task; the model's memory (the robot's RAM on a Jetson) should be
held only between ``configure`` and ``cleanup``. The transitions map onto the steps of
:class:`~.node.VlmServing`:

* ``configure``: the parameters are read, the model loaded and the kernels built, the publishers and the
  worker created (not serving yet). A bad parameter or a missing model fails the transition, with the
  reason in the log; the node stays unconfigured and can be configured again.
* ``activate``: subscriptions, services and diagnostics start, the publishers are enabled, ``ready`` goes out.
* ``deactivate``: no new prompts; the waiting ones are dropped and the running one cancelled, each with its
  terminal event, before the publishers are disabled. Parameters may still be set; engine changes are
  applied when the node is activated again.
* ``cleanup``: the model is freed (and the CUDA cache emptied).
* ``shutdown``: from any state, the steps back in order; the process then exits 0.

Out-of-order transitions are refused by the lifecycle state machine itself (rclpy), as the ROS 2
lifecycle design says. Parameters are declared at construction, so they can be set before ``configure``.
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
