"""The ROS 2 node ``orin_vlm``: camera images + text prompts in, streamed tokens out.

Topics (relative, so namespaces and remaps apply): subscribes ``image`` (sensor_msgs/Image),
``image/compressed`` (sensor_msgs/CompressedImage) and ``prompt`` (std_msgs/String); publishes
``tokens`` (streamed text, coalesced: ``token_stream.py``), ``response`` (the whole answer), ``status`` (one
JSON object per event, see ``status``) and ``/diagnostics`` (about 1 Hz). Services ``~/reset``
(forget the multi-turn conversation) and ``~/cancel`` (stop the running prompt, drop waiting ones).

Threading, and why: generation takes seconds, so it runs on one worker thread (``worker.py``) that owns every
mutating engine call (``generate``, ``reconfigure``, ``reset``). ROS callbacks only enqueue work or
flip flags, and a MultiThreadedExecutor with separate callback groups keeps services, parameter
changes and image updates responsive during a generation. ``Engine.cancel`` is the only engine call
made from another thread (it is thread-safe by contract); ``validate_changes``/``describe`` only read.
Parameter changes for the engine (paging, pool, kernels, graphs, dtype, ...) are validated at once,
so ``ros2 param set`` gets a reason for a refusal, then applied between two requests.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image
from std_msgs.msg import String
from std_srvs.srv import Trigger

from ..engine import Engine, EngineConfig, EngineError
from .image import ImageConversionError, ImageConverter, LatestImage, stamp_seconds
from .params import (
    RUNTIME_ENGINE_FIELDS,
    SAMPLING_FIELDS,
    check_changes,
    declare_parameters,
    engine_config,
    engine_kwargs,
    sampling_params,
)
from .request_queue import PendingPrompt, RequestQueue
from .status import backend_summary, engine_diagnostics, status_json
from .token_stream import TokenStream
from .worker import Worker

NODE_NAME = "orin_vlm"
# Identical image errors (a broken camera at 30 Hz) are reported at most this often.
IMAGE_ERROR_INTERVAL_S = 1.0
# Subscribers that exist when the node comes up match its new publishers within milliseconds on one
# machine; announcing `ready` a moment later lets them receive it.
READY_ANNOUNCE_DELAY_S = 0.5


class StartupError(RuntimeError):
    """The node cannot start (bad parameters, missing model); the message says what to fix."""


def startup_config(values: Mapping[str, Any]) -> EngineConfig:
    """The engine config of the declared parameter values; StartupError before anything loads when the
    values are out of bounds or the model directory is not one."""
    reason = check_changes(values)
    if reason:
        raise StartupError(f"invalid parameter value: {reason}")
    config = engine_config(values)
    if not (config.model_dir / "config.json").is_file():
        if not values["model_path"]:
            raise StartupError(f"the embedded default model is missing at {config.model_dir} (reinstall the package)")
        raise StartupError(
            f"model_path {str(config.model_dir)!r} is not a Hugging Face model directory (no config.json there); "
            "pass -p model_path:=/path/to/Qwen3-VL-... or leave it empty for the embedded default model"
        )
    return config


class _Publishers:
    """The worker's :class:`~.worker.Outputs`: the node's tokens (coalesced, off the generation thread),
    response and status topics."""

    def __init__(self, node: VlmNode, token_period_ms: int) -> None:
        self._node = node
        self.token_stream = TokenStream(lambda text: node._tokens_pub.publish(String(data=text)), token_period_ms / 1e3)

    def tokens(self, text: str) -> None:
        self.token_stream.push(text)

    def end_tokens(self) -> None:
        if not self.token_stream.flush():
            self._node.get_logger().warning("tokens of the last answer were still being published after 5 s")
        self.token_stream.start_answer()

    def response(self, text: str) -> None:
        self._node._response_pub.publish(String(data=text))

    def status(self, event: str, request_id: str | None, **fields: Any) -> None:
        self._node._publish_status(event, request_id, **fields)


class VlmNode(Node):
    """The ``orin_vlm`` node. Construction loads the model; raises StartupError/EngineError."""

    def __init__(self, **node_kwargs: Any) -> None:
        super().__init__(NODE_NAME, **node_kwargs)
        self._lock = threading.Lock()  # guards _values, _session_id and the counters
        self._values: dict[str, Any] = declare_parameters(self)
        config = startup_config(self._values)
        t0 = time.monotonic()
        self._engine = Engine(config)
        self._session_counter = 0
        self._session_id = self._new_session_id()
        self._request_counter = 0
        self._image_errors: dict[str, float] = {}

        self._converter = ImageConverter()
        self._latest = LatestImage()
        self._queue = RequestQueue(int(self._values["max_queue"]))
        self._create_interfaces()
        self._outputs = _Publishers(self, int(self._values["token_publish_period_ms"]))
        self._worker = Worker(
            self._engine,
            self._queue,
            self._outputs,
            engine_kwargs(self._values, RUNTIME_ENGINE_FIELDS),
            self._revert,
            self._current_session,
        )
        described = self._describe()
        backend = backend_summary(described)
        log = self.get_logger().warning if described.get("kernels_degraded") else self.get_logger().info
        log(
            f"ready in {time.monotonic() - t0:.1f} s: model {config.model_dir}, device {described.get('device', '?')}, "
            f"dtype {described.get('dtype', '?')}, images via {self._converter.backend}; {backend}"
        )
        self._ready_note = backend
        self._ready_timer = self.create_timer(READY_ANNOUNCE_DELAY_S, self._announce_ready)

    def _create_interfaces(self) -> None:
        """Publishers, subscriptions, services and timers; callbacks in groups that keep services responsive."""
        stream_qos = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
        self._tokens_pub = self.create_publisher(String, "tokens", stream_qos)
        self._response_pub = self.create_publisher(String, "response", 10)
        self._status_pub = self.create_publisher(String, "status", QoSProfile(depth=200))
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)

        images = MutuallyExclusiveCallbackGroup()
        prompts = MutuallyExclusiveCallbackGroup()
        services = ReentrantCallbackGroup()
        self.create_subscription(Image, "image", self._on_image, qos_profile_sensor_data, callback_group=images)
        self.create_subscription(
            CompressedImage, "image/compressed", self._on_compressed, qos_profile_sensor_data, callback_group=images
        )
        self.create_subscription(String, "prompt", self._on_prompt, QoSProfile(depth=100), callback_group=prompts)
        self.create_service(Trigger, "~/reset", self._on_reset, callback_group=services)
        self.create_service(Trigger, "~/cancel", self._on_cancel, callback_group=services)
        self.create_timer(1.0, self._publish_diagnostics, callback_group=MutuallyExclusiveCallbackGroup())
        self.add_on_set_parameters_callback(self._on_set_parameters)

    def _announce_ready(self) -> None:
        """The first status event: the node serves, and which attention path and KV pool it runs with."""
        self.destroy_timer(self._ready_timer)
        self._publish_status("ready", None, note=self._ready_note)

    # ---------------------------------------------------------------- inputs (executor threads)

    def _on_image(self, msg: Image) -> None:
        if float(self._values["image_max_age_s"]) <= 0:
            return  # images disabled: do not spend CPU converting frames nobody will use
        stamp = stamp_seconds(msg.header.stamp)
        try:
            self._latest.set(self._converter.image_to_rgb(msg), stamp)
        except ImageConversionError as exc:
            self._report_image_error(f"image rejected: {exc}", stamp)

    def _on_compressed(self, msg: CompressedImage) -> None:
        if float(self._values["image_max_age_s"]) <= 0:
            return
        stamp = stamp_seconds(msg.header.stamp)
        try:
            self._latest.set(self._converter.compressed_to_rgb(msg), stamp)
        except ImageConversionError as exc:
            self._report_image_error(f"compressed image rejected: {exc}", stamp)

    def _report_image_error(self, error: str, stamp: float) -> None:
        now = time.monotonic()
        if now - self._image_errors.get(error, -1e9) < IMAGE_ERROR_INTERVAL_S:
            return
        if len(self._image_errors) > 64:  # error texts carry sizes: keep the throttle table small
            self._image_errors = {k: t for k, t in self._image_errors.items() if now - t < IMAGE_ERROR_INTERVAL_S}
        self._image_errors[error] = now
        self.get_logger().warning(error)
        self._publish_status("error", None, error=error, image_stamp=stamp)

    def _on_prompt(self, msg: String) -> None:
        with self._lock:
            self._request_counter += 1
            request_id = f"req-{self._request_counter}"
            values = dict(self._values)
        text = msg.data
        if not text.strip():
            self._publish_status("error", request_id, finish_reason="error", error="empty prompt: nothing to answer")
            return
        image, stamp, note = self._latest.pick(float(values["image_max_age_s"]))
        system_prompt = str(values["system_prompt"]) or None
        item = PendingPrompt(
            request_id=request_id,
            text=text,
            sampling=sampling_params(values),
            system_prompt=system_prompt,
            image=image,
            image_stamp=stamp if image is not None else None,
            accepted_at=time.monotonic(),
            note=note,
        )
        # accepted goes out before the item is visible to the worker, so it always precedes started.
        self._publish_status("accepted", request_id, image_stamp=item.image_stamp, note=note)
        for dropped in self._queue.put(item):
            self._publish_dropped(
                dropped, f"queue full (max_queue={self._queue.max_size}): oldest waiting prompt dropped"
            )

    # ---------------------------------------------------------------- services

    def _on_reset(self, _request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        with self._lock:
            old = self._session_id
            self._session_id = self._new_session_id()
        self._worker.queue_changes({}, reset_session=old)
        response.success = True
        response.message = "conversation reset: the next prompt starts a new session"
        return response

    def _on_cancel(self, _request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        current = self._worker.cancel_running()
        waiting = self._queue.drain()
        for item in waiting:
            self._publish_dropped(item, "cancelled by ~/cancel before it started")
        response.success = True
        response.message = (
            f"cancelled {current if current else 'nothing running'}; dropped {len(waiting)} waiting prompt(s)"
        )
        return response

    # ---------------------------------------------------------------- parameters

    def _on_set_parameters(self, params: list[Parameter]) -> SetParametersResult:
        changes = {p.name: p.value for p in params}
        with self._lock:
            current = dict(self._values)
        pending = self._worker.pending_changes()
        reason = check_changes(changes)
        if reason:
            return SetParametersResult(successful=False, reason=reason)
        after = {**current, **changes}
        before_kw, after_kw = engine_kwargs(current, RUNTIME_ENGINE_FIELDS), engine_kwargs(after, RUNTIME_ENGINE_FIELDS)
        # Fields that follow from a changed parameter (max_sessions from multi_turn) change with it.
        engine_changes = {
            name: value for name, value in after_kw.items() if name in changes or value != before_kw[name]
        }
        to_validate: dict[str, Any] = {**pending, **engine_changes}
        if changes.keys() & set(SAMPLING_FIELDS):
            to_validate["sampling"] = sampling_params(after)  # checked now, used per request
        if to_validate:
            try:
                self._engine.validate_changes(**to_validate)
            except ValueError as exc:
                return SetParametersResult(successful=False, reason=str(exc))
        reset = None
        with self._lock:
            self._values.update(changes)
            if "multi_turn" in changes and bool(changes["multi_turn"]) != bool(current["multi_turn"]):
                reset, self._session_id = self._session_id, self._new_session_id()
        if "token_publish_period_ms" in changes:
            self._outputs.token_stream.set_period(int(changes["token_publish_period_ms"]) / 1e3)
        if "max_queue" in changes:
            for dropped in self._queue.set_max_size(int(changes["max_queue"])):
                self._publish_dropped(dropped, f"max_queue lowered to {changes['max_queue']}")
        self._worker.queue_changes(engine_changes, reset_session=reset)
        return SetParametersResult(successful=True)

    def _revert(self, applied: Mapping[str, Any]) -> None:
        """Put the parameters of a failed reconfiguration back to what the engine really runs."""
        revert = [Parameter(n, value=v) for n, v in applied.items() if n in RUNTIME_ENGINE_FIELDS]
        if revert:
            self.set_parameters(revert)

    def _current_session(self) -> str | None:
        """The conversation a prompt joins when it starts (after any pending reset); None without multi_turn."""
        with self._lock:
            return self._session_id if self._values["multi_turn"] else None

    # ---------------------------------------------------------------- reporting

    def _publish_status(self, event: str, request_id: str | None, **fields: Any) -> None:
        self._status_pub.publish(String(data=status_json(event, request_id, **fields)))  # type: ignore[arg-type]

    def _publish_dropped(self, item: PendingPrompt, why: str) -> None:
        self._publish_status("dropped", item.request_id, note=why, image_stamp=item.image_stamp)

    def _describe(self) -> dict[str, Any]:
        try:
            return dict(self._engine.describe())
        except Exception as exc:  # diagnostics must never take the node down
            return {"describe_error": repr(exc)}

    def _publish_diagnostics(self) -> None:
        worker = self._worker.state()
        state = "generating" if worker.current_id else "idle"
        described = self._describe()
        level, message, values = engine_diagnostics(
            described, state, len(self._queue), worker.completed, worker.last_metrics
        )
        status = DiagnosticStatus(name=f"{self.get_name()}: engine", level=level, message=message)
        status.values = [KeyValue(key=k, value=v) for k, v in values]
        status.hardware_id = str(described.get("device", NODE_NAME))
        array = DiagnosticArray(status=[status])
        array.header.stamp = self.get_clock().now().to_msg()
        self._diag_pub.publish(array)

    def _new_session_id(self) -> str:
        self._session_counter += 1
        return f"{NODE_NAME}-session-{self._session_counter}"

    # ---------------------------------------------------------------- shutdown

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Stop the worker: cancel the running prompt, wake the worker, wait briefly for it; then publish the
        tokens still pending."""
        self._worker.stop(timeout_s)
        self._outputs.token_stream.close(timeout_s)


def main(args: list[str] | None = None) -> int:
    """Entry point of ``vlm_node`` / ``python -m orin_vlm_node.ros.node``.

    Returns 1 when the node cannot start (the reason is logged). After a clean shutdown (SIGINT,
    ``ros2 launch`` stopping it) the process exits right away with ``os._exit(0)`` once ROS is shut
    down and output is flushed: the interpreter's own teardown of torch takes seconds on a loaded
    Jetson, and launch escalates to SIGTERM/SIGKILL when a node lingers.
    """
    rclpy.init(args=args)
    try:
        node = VlmNode()
    except Exception as exc:
        if not rclpy.ok():  # SIGINT while the model was loading: a requested stop, not a failure
            print(f"{NODE_NAME}: interrupted during startup", file=sys.stderr, flush=True)
            return 0
        if not isinstance(exc, (StartupError, EngineError, ValueError)):
            raise
        message = str(exc) if isinstance(exc, EngineError) else f"cannot start: {exc}"
        rclpy.logging.get_logger(NODE_NAME).fatal(message)
        rclpy.try_shutdown()
        return 1
    executor = MultiThreadedExecutor(num_threads=4)
    executor.add_node(node)
    try:
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        # The context is already shut down here, so no rosout logging: plain stderr.
        print(f"{NODE_NAME}: shutting down", file=sys.stderr, flush=True)
        node.shutdown()
        executor.shutdown(timeout_sec=1.0)
        node.destroy_node()
        rclpy.try_shutdown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
