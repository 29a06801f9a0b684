"""The ROS 2 node ``orin_vlm``: camera images + text prompts in, streamed tokens out.

Topics, services and parameters are listed in the README. One worker thread (``worker.py``) owns every
engine call that changes it (``generate``, ``reconfigure``, ``reset``); ROS callbacks only enqueue work or
flip flags, so one executor thread keeps services, parameter changes and images responsive during an answer.
``Engine.cancel`` is the one engine call made from another thread (thread-safe); ``validate_changes`` and
``describe`` only read. A parameter change is validated at once (``ros2 param set`` gets the reason of a
refusal), then applied between two requests. docs/architecture.md follows a prompt through it.
"""

from __future__ import annotations

import functools
import gc
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import SetParametersResult
from rclpy.duration import Duration
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CompressedImage, Image
from std_msgs.msg import String
from std_srvs.srv import Trigger

from ..engine import Engine
from ..engine.description import backend_summary, serving_summary
from ..engine.output_format import format_from_json
from ..remote.engine import RemoteEngine
from .camera_intake import CameraIntake
from .channel import Channel
from .detections import vision_msgs
from .frame_history import FrameHistory
from .image import (
    ImageConverter,
    LatestFrames,
)
from .image_inputs import ImageInputs
from .log_bridge import PackageLogs
from .names import NODE_NAME
from .params import (
    RUNTIME_ENGINE_FIELDS,
    SAMPLING_FIELDS,
    channel_values,
    check_changes,
    declare_parameters,
    engine_kwargs,
    sampling_params,
    unknown_parameters_problem,
)
from .prompt_message import PromptReader, json_prompt, pending_prompt, plain_prompt
from .request_queue import RequestQueue
from .startup import StartupError, channel_list, context_problem, prompt_problem, remote_startup, startup_config
from .status import engine_diagnostics, history_diagnostics
from .status_events import READY_POLL_S, READY_SLOW_POLL_S, StatusEvents
from .worker import Worker, on_passing_thread

# How long a stopping node waits, in all, for subscribers to acknowledge what it published last.
ACK_WAIT_S = 0.5


class VlmServing:
    """The node's work, shared by the plain node (:class:`VlmNode`) and the managed one
    (``lifecycle_node.VlmLifecycleNode``); the class it is mixed into is an rclpy ``Node``.

    Four steps, which the plain node takes at once and the managed node one per lifecycle transition:
    :meth:`_declare` (parameters; settable from then on), :meth:`_load` (the model, the publishers, the
    queue and the worker: everything that lives as long as the model), :meth:`_open` (subscriptions,
    services, diagnostics, the worker thread: serving), and back: :meth:`_close` (every open prompt ends
    with its terminal event) and :meth:`_unload` (the model and its memory freed).
    """

    def _declare(self) -> None:
        self._package_logs = PackageLogs(self.get_logger())  # the ROS-free layers' records, in the node's log
        self._lock = threading.Lock()  # guards _values, the channels' session ids and the counters
        self._status_events = StatusEvents(self.get_logger().warning)
        self._values: dict[str, Any] = declare_parameters(self)
        given = getattr(self, "_parameter_overrides", {})  # rclpy keeps no public list of what it was given
        unknown = unknown_parameters_problem(given, self.get_parameters_by_prefix(""))  # all declared names
        if unknown:
            self.get_logger().warning(unknown)
        self._engine: Engine | RemoteEngine | None = None  # None until loaded (a managed node before configure)
        self._worker: Worker | None = None
        self._refusing: str | None = "node not serving"  # why prompts are refused; None while serving
        self._session_counter = 0
        self._request_counter = 0
        self._channels: dict[str, Channel] = {}
        self._serving_entities: list[Any] = []  # subscriptions, services and timers of the serving state
        self.finished = False  # the node is done and its process may exit (a managed node shut down)
        self.add_on_set_parameters_callback(self._on_set_parameters)

    def _make_publisher(self, msg_type: Any, topic: str, qos: QoSProfile | int) -> Any:
        return self.create_publisher(msg_type, topic, qos)

    def _load(self) -> float:
        """Load the model and create what lives as long as it; the seconds it took. StartupError/EngineError
        (nothing left loaded) when the parameters or the model are unusable.

        Depths: ``status``/``tokens`` keep three events per prompt of a ``prompt_queue_depth`` burst, so no
        event is overwritten before a subscriber took it.
        """
        t0 = time.monotonic()
        if self._values["backend"] == "openai":
            self._engine = remote_startup(self._values)
        else:
            config = startup_config(self._values)
            self._engine = on_passing_thread(lambda: Engine(config))  # see worker.py: no OpenMP pool left behind
        reason = self._context_problem(self._values)
        if reason:
            self._engine = None
            raise StartupError(reason)
        self._converter = ImageConverter()
        names = channel_list(self._values)
        topics = [t for ch in names for t in channel_values(self._values, ch)["image_topics"]]
        self._frames = LatestFrames(list(dict.fromkeys(topics)))  # each camera once, in first-use order
        self._history = FrameHistory(self._frames.topics)
        self._cameras = CameraIntake(self._frames, self._history, self._converter, self._values, self._tell_image_error)
        self._queue = RequestQueue(int(self._values["max_queue"]))
        prompt_depth = int(self._values["prompt_queue_depth"])
        stream_qos = QoSProfile(depth=max(1000, 3 * prompt_depth), reliability=ReliabilityPolicy.RELIABLE)
        period_s = int(self._values["token_publish_period_ms"]) / 1e3
        detection_msgs, draw = vision_msgs(), bool(self._values["detections_image"])
        if detection_msgs is None:
            self.get_logger().info("vision_msgs is not installed: detections are published on detections_json only")
        self._channels = {
            name: Channel(name, self._make_publisher, stream_qos, period_s, self._status_events.publish,
                          self.get_logger().warning, self._new_session_id(), detection_msgs, draw)
            for name in names
        }  # fmt: skip
        self._diag_pub = self._make_publisher(DiagnosticArray, "/diagnostics", 10)
        self._worker = Worker(
            self._engine,
            self._queue,
            self._channels,
            engine_kwargs(self._values, RUNTIME_ENGINE_FIELDS),
            self._revert,
            self._current_session,
        )
        return time.monotonic() - t0

    def _open(self, load_s: float) -> None:
        """Serve: subscriptions, services and diagnostics, the worker thread; ``ready`` announced.

        The prompt subscription holds ``prompt_queue_depth`` messages (a burst beyond it would be lost by DDS
        before the node saw it).
        """
        self._images = ImageInputs(
            self,
            str(self._values["image_reliability"]),
            [
                entry
                for topic in self._frames.topics
                for entry in (
                    (topic, Image, functools.partial(self._cameras.on_image, topic)),
                    (f"{topic}/compressed", CompressedImage, functools.partial(self._cameras.on_compressed, topic)),
                )
            ],
        )
        depth = QoSProfile(depth=int(self._values["prompt_queue_depth"]))
        self._serving_entities = [  # (how to remove it, it)
            (self.destroy_timer, self.create_timer(1.0, self._publish_diagnostics)),
        ]
        for ch in self._channels.values():
            self._serving_entities += [
                (self.destroy_subscription, self.create_subscription(
                    String, ch.topic("prompt"), functools.partial(self._on_prompt, ch, plain_prompt), depth)),
                (self.destroy_subscription, self.create_subscription(
                    String, ch.topic("prompt_json"), functools.partial(self._on_prompt, ch, json_prompt), depth)),
                (self.destroy_service, self.create_service(
                    Trigger, ch.service("reset"), functools.partial(self._on_reset, ch))),
                (self.destroy_service, self.create_service(
                    Trigger, ch.service("cancel"), functools.partial(self._on_cancel, ch))),
            ]  # fmt: skip
        self._refusing = None
        self._worker.start()
        described = self._describe()
        backend = backend_summary(described)
        log = self.get_logger().warning if described.get("kernels_degraded") else self.get_logger().info
        log(f"ready in {load_s:.1f} s: {serving_summary(described)}, images via {self._converter.backend}; {backend}")
        self._status_events.start(backend, time.monotonic())
        self._ready_timer = self.create_timer(READY_POLL_S, self._announce_ready)

    def _close(self, why: str, timeout_s: float = 2.0) -> None:
        """Stop serving while the ROS context can still publish: refuse new prompts, drop the waiting ones
        and cancel the running one, each with its terminal event (``dropped``; ``finished`` with reason
        ``cancelled``), publish the tokens still pending, give subscribers a moment to take it all, then
        remove the subscriptions, services and timers."""
        self._refusing = why
        self._images.close()
        for destroy, entity in self._serving_entities:
            destroy(entity)
        self._serving_entities = []
        self._worker.stop(timeout_s, why)
        for ch in self._channels.values():
            ch.token_stream.flush(timeout_s)
        acked_by = time.monotonic() + ACK_WAIT_S  # one bound for all publishers, not one each
        for publisher in (p for ch in self._channels.values() for p in ch.publishers):
            publisher.wait_for_all_acked(Duration(seconds=max(0.0, acked_by - time.monotonic())))
        self.destroy_timer(self._ready_timer)

    def _unload(self) -> None:
        """Free the model and everything that lived as long as it (after :meth:`_close`)."""
        for ch in self._channels.values():
            ch.token_stream.close()
        for publisher in (*(p for ch in self._channels.values() for p in ch.publishers), self._diag_pub):
            self._destroy_publisher(publisher)
        self._channels = {}
        self._engine.close()
        self._engine = self._worker = None
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def _destroy_publisher(self, publisher: Any) -> None:
        self.destroy_publisher(publisher)

    def _announce_ready(self) -> None:
        """The first status event of each channel, once its status has a subscriber (``status_events``)."""
        outcome = self._status_events.poll(self._channels.values(), time.monotonic())
        if outcome:
            self.destroy_timer(self._ready_timer)
        if outcome == "slow":
            self._ready_timer = self.create_timer(READY_SLOW_POLL_S, self._announce_ready)

    # ---------------------------------------------------------------- inputs (the executor's thread)

    def _tell_image_error(self, topic: str, error: str, stamp: float) -> None:
        """Log a camera's unusable frame and tell the channels that look at ``topic``."""
        self.get_logger().warning(error)
        for ch in self._channels.values():
            if topic in channel_values(self._values, ch.name)["image_topics"]:
                ch.status("error", None, error=error, image_stamp=stamp)

    def _on_prompt(self, ch: Channel, read: PromptReader, msg: String) -> None:
        with self._lock:
            self._request_counter += 1
            request_id = f"{ch.name}-req-{self._request_counter}" if ch.name else f"req-{self._request_counter}"
            values = channel_values(self._values, ch.name)
        try:
            message = read(msg.data)
            refused = prompt_problem(message.text) or (self._refusing and f"{self._refusing}: prompt not accepted")
            if not refused:
                frames = self._frames.pick(float(values["image_max_age_s"]), values["image_topics"])
                for topic, error, stamp in frames.errors:  # a frame whose header passed but whose data did not
                    self._cameras.report_error(topic, error, stamp)
                item = pending_prompt(request_id, message, values, frames, ch.name, self._history)
        except ValueError as exc:
            refused = str(exc)
        if refused:
            ch.status("error", request_id, finish_reason="error", error=refused)
            return
        # accepted goes out before the item is visible to the worker, so it always precedes started.
        ch.status("accepted", request_id, note=item.note, **item.status_fields())
        for dropped in self._queue.put(item):
            self._worker.drop(dropped, f"queue full (max_queue={self._queue.max_size}): oldest waiting prompt dropped")

    # ---------------------------------------------------------------- services

    def _on_reset(self, ch: Channel, _request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        with self._lock:
            old, ch.session_id = ch.session_id, self._new_session_id()
        self._worker.queue_changes({}, reset_sessions=[old])
        response.success = True
        response.message = "conversation reset: the next prompt starts a new session"
        return response

    def _on_cancel(self, ch: Channel, _request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        cancelled, dropped = self._worker.cancel(ch.name)
        current = ", ".join(cancelled)
        response.success = True
        response.message = f"cancelled {current if current else 'nothing running'}; dropped {dropped} waiting prompt(s)"
        return response

    # ---------------------------------------------------------------- parameters

    def _on_set_parameters(self, params: list[Parameter]) -> SetParametersResult:
        changes = {p.name: list(p.value) if isinstance(p.value, (list, tuple)) else p.value for p in params}
        with self._lock:
            current = dict(self._values)
        reason = check_changes(changes)
        if self._engine is None:  # a managed node before configure: the values are taken when it loads
            if not reason:
                with self._lock:
                    self._values.update(changes)
            return SetParametersResult(successful=not reason, reason=reason or "")
        pending = self._worker.pending_changes()
        after = {**current, **changes}
        if not reason and any(name.rpartition(".")[2] in ("max_context_tokens", "system_prompt") for name in changes):
            reason = self._context_problem(after)
        if reason:
            return SetParametersResult(successful=False, reason=reason)
        before_kw, after_kw = engine_kwargs(current, RUNTIME_ENGINE_FIELDS), engine_kwargs(after, RUNTIME_ENGINE_FIELDS)
        # Fields that follow from a changed parameter (max_sessions from multi_turn) change with it.
        engine_changes = {
            name: value for name, value in after_kw.items() if name in changes or value != before_kw[name]
        }
        try:
            if pending or engine_changes:  # a change still waiting for the running prompt is replaced by a new one
                self._engine.validate_changes(**{**pending, **engine_changes})
            if any(name.rpartition(".")[2] in SAMPLING_FIELDS for name in changes):
                for channel in self._channels:  # checked now, used per request
                    self._engine.validate_changes(sampling=sampling_params(channel_values(after, channel)))
            for name in (n for n in changes if n.rpartition(".")[2] == "output_format" and changes[n]):
                self._engine.validate_output(format_from_json(changes[name]))
        except ValueError as exc:
            return SetParametersResult(successful=False, reason=str(exc))
        resets = []
        with self._lock:
            self._values.update(changes)
            if "multi_turn" in changes and bool(changes["multi_turn"]) != bool(current["multi_turn"]):
                for ch in self._channels.values():
                    resets.append(ch.session_id)
                    ch.session_id = self._new_session_id()
        if "token_publish_period_ms" in changes:
            for ch in self._channels.values():
                ch.token_stream.set_period(int(changes["token_publish_period_ms"]) / 1e3)
        if "max_queue" in changes:
            for dropped in self._queue.set_max_size(int(changes["max_queue"])):
                self._worker.drop(dropped, f"max_queue lowered to {changes['max_queue']}")
        self._worker.queue_changes(engine_changes, reset_sessions=resets)
        return SetParametersResult(successful=True)

    def _context_problem(self, values: Mapping[str, Any]) -> str | None:
        return context_problem(values, self._engine.shortest_prompt_tokens)

    def _revert(self, applied: Mapping[str, Any]) -> None:
        """Put the parameters of a failed reconfiguration back to what the engine really runs."""
        revert = [Parameter(n, value=v) for n, v in applied.items() if n in RUNTIME_ENGINE_FIELDS]
        if revert:
            self.set_parameters(revert)

    def _current_session(self, channel: str) -> str | None:
        """The channel's conversation a prompt joins when it starts (after any pending reset); None without
        multi_turn."""
        with self._lock:
            return self._channels[channel].session_id if self._values["multi_turn"] else None

    # ---------------------------------------------------------------- reporting

    def _describe(self) -> dict[str, Any]:
        try:
            return dict(self._engine.describe())
        except Exception as exc:  # diagnostics must never take the node down
            return {"describe_error": repr(exc)}

    def _publish_diagnostics(self) -> None:
        worker = self._worker.state()
        state = "generating" if worker.running else "idle"
        described = self._describe()
        level, message, values = engine_diagnostics(
            described, state, len(self._queue), sum(worker.completed.values()), worker.last_metrics
        )
        values.append(("running_requests", str(len(worker.running))))  # decoding together in one batch
        values += history_diagnostics(self._history.stats(), int(self._values["video_history_mb"]))
        if len(self._channels) > 1 or "" not in self._channels:
            for ch in self._channels.values():
                prefix = f"channel.{ch.name}."
                values += [
                    (prefix + "state", "generating" if ch.name in worker.running else "idle"),
                    (prefix + "queue_waiting", str(self._queue.waiting(ch.name))),
                    (prefix + "requests_completed", str(worker.completed.get(ch.name, 0))),
                ]
        status = DiagnosticStatus(name=f"{self.get_name()}: engine", level=level, message=message)
        status.values = [KeyValue(key=k, value=v) for k, v in values]
        status.hardware_id = str(described.get("device", NODE_NAME))
        array = DiagnosticArray(status=[status])
        array.header.stamp = self.get_clock().now().to_msg()
        self._diag_pub.publish(array)

    def _new_session_id(self) -> str:
        self._session_counter += 1
        return f"{NODE_NAME}-session-{self._session_counter}"

    def destroy_node(self) -> None:
        """The rclpy node's teardown, the package's records no longer routed to it."""
        self._package_logs.detach()
        super().destroy_node()  # type: ignore[misc]  # the rclpy Node this class is mixed into


class VlmNode(VlmServing, Node):
    """The ``orin_vlm`` node. Construction loads the model and serves; raises StartupError/EngineError."""

    def __init__(self, **node_kwargs: Any) -> None:
        Node.__init__(self, NODE_NAME, **node_kwargs)
        self._declare()
        self._open(self._load())

    def shutdown(self, why: str, timeout_s: float = 2.0) -> None:
        """Stop in order while the ROS context can still publish (see :meth:`VlmServing._close`)."""
        self._close(why, timeout_s)
        for ch in self._channels.values():
            ch.token_stream.close(timeout_s)
