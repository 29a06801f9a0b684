"""Talk to a running ``orin_vlm`` node from Python: publish images and prompts, record what it says.

Used by the integration tests, ``tools/demo.py`` and anyone scripting the node. The client spins its
own rclpy context (with the caller's domain id, no signal handlers) on a background thread and
records every ``status`` event, ``tokens`` delta and ``response`` in arrival order under one
condition variable, so callers wait with predicates instead of sleeps.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from support.node_process import NodeProcess

NODE_NAME = "orin_vlm"
TERMINAL = ("finished", "dropped", "error")


class VlmClient:
    """The test side: publishers for image/prompt, recorders for tokens/response/status, service calls.

    Everything received is appended under one condition variable, so tests wait with predicates
    instead of sleeps.
    """

    def __init__(
        self,
        domain_id: int,
        node_name: str = NODE_NAME,
        namespace: str = "",
        on_token: Callable[[str], None] | None = None,
        image_topic: str = "image",
        prompt_topic: str | None = None,
        channel: str = "",
    ) -> None:
        """``channel``: talk to that channel of a node with ``channels`` (its topics and services);
        ``prompt_topic`` overrides where prompts go (a remapped node)."""
        import rclpy
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from rclpy.signals import SignalHandlerOptions
        from sensor_msgs.msg import CompressedImage, Image
        from std_msgs.msg import String

        self._rclpy = rclpy
        self.context = rclpy.Context()
        rclpy.init(context=self.context, domain_id=domain_id, signal_handler_options=SignalHandlerOptions.NO)
        self.node = rclpy.create_node(f"vlm_client_{os.getpid()}", context=self.context, namespace=namespace)
        ns = namespace.strip("/")
        self.fqn = f"/{ns}/{node_name}" if ns else f"/{node_name}"  # the node's fully qualified name
        self.channel_fqn = f"{self.fqn}/{channel}" if channel else self.fqn  # where the channel's services are
        under = f"{channel}/" if channel else ""
        self._cond = threading.Condition()
        self.status: list[dict[str, Any]] = []
        self.tokens: list[str] = []
        self.responses: list[str] = []
        self.diagnostics: list[Any] = []
        reliable = QoSProfile(depth=5000, reliability=ReliabilityPolicy.RELIABLE)
        self.image_pub = self.node.create_publisher(Image, image_topic, 10)
        self.compressed_pub = self.node.create_publisher(CompressedImage, f"{image_topic}/compressed", 10)
        self.prompt_pub = self.node.create_publisher(String, prompt_topic or f"{under}prompt", QoSProfile(depth=1000))
        self.prompt_json_pub = self.node.create_publisher(String, f"{under}prompt_json", QoSProfile(depth=1000))
        self._subs = [
            self.node.create_subscription(String, f"{under}status", self._on_status, reliable),
            self.node.create_subscription(String, f"{under}tokens", self._on_token, reliable),
            self.node.create_subscription(
                String, f"{under}response", lambda m: self._append(self.responses, m.data), reliable
            ),
        ]
        self._string = String
        self._token_callback = on_token
        self._executor = SingleThreadedExecutor(context=self.context)
        self._executor.add_node(self.node)
        self._spin = threading.Thread(target=self._spin_forever, name="ros_client_spin", daemon=True)
        self._spin.start()

    # ------------------------------------------------------------------ recording

    def _spin_forever(self) -> None:
        try:
            self._executor.spin()
        except Exception:  # context shut down from close()
            pass

    def _append(self, target: list, value: Any) -> None:
        with self._cond:
            target.append(value)
            self._cond.notify_all()

    def _on_token(self, msg: Any) -> None:
        if self._token_callback is not None:
            self._token_callback(msg.data)
        self._append(self.tokens, msg.data)

    def _on_status(self, msg: Any) -> None:
        self._append(self.status, json.loads(msg.data))

    def subscribe_diagnostics(self) -> None:
        from diagnostic_msgs.msg import DiagnosticArray

        self._subs.append(
            self.node.create_subscription(
                DiagnosticArray, "/diagnostics", lambda m: self._append(self.diagnostics, m), 10
            )
        )

    def node_diagnostics(
        self, timeout: float = 10.0, where: Callable[[dict[str, str]], bool] = lambda values: True
    ) -> tuple[Any, dict[str, str]]:
        """The node's latest ``/diagnostics`` status whose key/values satisfy ``where``, with those values
        (after :meth:`subscribe_diagnostics`); AssertionError when none comes within ``timeout``."""

        def latest() -> tuple[Any, dict[str, str]] | None:
            for array in reversed(self.diagnostics):
                for status in (s for s in array.status if s.name.startswith(NODE_NAME)):
                    values = {kv.key: kv.value for kv in status.values}
                    if where(values):
                        return status, values
            return None

        return self.wait_for(latest, timeout, "the node's /diagnostics")

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        """Wait until ``predicate()`` (evaluated under the lock) is truthy; AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                value = predicate()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"timed out after {timeout:.0f} s waiting for {what}; status={self.status[-8:]}"
                    )
                self._cond.wait(min(left, 0.1))

    def events(self, request_id: str | None = None, event: str | None = None) -> list[dict[str, Any]]:
        with self._cond:
            return [
                e
                for e in self.status
                if (request_id is None or e["request_id"] == request_id) and (event is None or e["event"] == event)
            ]

    # ------------------------------------------------------------------ readiness

    def wait_until_connected(self, node: NodeProcess | None = None, timeout: float = 90.0) -> None:
        """The node creates its topics and services after the model is loaded, so matching all of
        them means it is ready to answer."""
        deadline = time.monotonic() + timeout
        services = [f"{self.channel_fqn}/reset", f"{self.channel_fqn}/cancel", f"{self.fqn}/set_parameters"]
        while time.monotonic() < deadline:
            if node is not None and not node.alive():
                raise AssertionError(f"node exited with {node.proc.returncode} during startup:\n{node.output()}")
            matched = (
                self.prompt_pub.get_subscription_count() > 0
                and self.image_pub.get_subscription_count() > 0
                and all(sub.get_publisher_count() > 0 for sub in self._subs[:3])
            )
            names = {name for name, _ in self.node.get_service_names_and_types()}
            if matched and all(s in names for s in services):
                return
            time.sleep(0.1)
        raise AssertionError(f"node not ready after {timeout:.0f} s:\n{node.output() if node else ''}")

    # ------------------------------------------------------------------ inputs

    def publish_image(self, msg: Any, repeat: int = 3) -> None:
        """Images go best-effort (sensor-data QoS on the node): send a few copies a moment apart."""
        for _ in range(repeat):
            self.image_pub.publish(msg)
            time.sleep(0.05)
        time.sleep(0.15)

    def publish_compressed(self, msg: Any) -> None:
        for _ in range(3):
            self.compressed_pub.publish(msg)
            time.sleep(0.05)
        time.sleep(0.15)

    def send_prompt(self, text: str | dict[str, Any]) -> None:
        """A plain prompt on ``prompt``, or a JSON message (a dict) on ``prompt_json``."""
        if isinstance(text, dict):
            self.prompt_json_pub.publish(self._string(data=json.dumps(text)))
        else:
            self.prompt_pub.publish(self._string(data=text))

    def ask(self, text: str | dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        """Publish a prompt (a dict: a ``prompt_json`` message) and wait for its terminal event. Returns a dict
        with the request's ``events``, the terminal ``status``, the ``tokens`` streamed meanwhile and the
        ``response``. Use with one prompt in flight at a time (tokens carry no request id)."""
        with self._cond:
            known = {e["request_id"] for e in self.status}
            n_tokens, n_responses = len(self.tokens), len(self.responses)
        self.send_prompt(text)
        first = self.wait_for(
            lambda: next((e for e in self.status if e["request_id"] and e["request_id"] not in known), None),
            timeout,
            f"the node to take prompt {str(text)[:40]!r}",
        )
        rid = first["request_id"]
        final = self.wait_for(
            lambda: next(
                (e for e in self.status if e["request_id"] == rid and e["event"] in TERMINAL),
                None,
            ),
            timeout,
            f"request {rid} to end",
        )
        response = None
        if final["event"] == "finished":
            self.wait_for(lambda: len(self.responses) > n_responses, 10.0, f"the response of {rid}")
            response = self.responses[n_responses]
            self._settle_tokens()
        with self._cond:
            tokens = list(self.tokens[n_tokens:])
        return {"request_id": rid, "events": self.events(rid), "status": final, "tokens": tokens, "response": response}

    def _settle_tokens(self, quiet: float = 0.3) -> None:
        """Tokens and response are separate topics: wait until no token arrived for ``quiet`` s."""
        last = -1
        while True:
            with self._cond:
                count = len(self.tokens)
            if count == last:
                return
            last = count
            time.sleep(quiet)

    # ------------------------------------------------------------------ services

    def _call(self, srv_type: Any, name: str, request: Any, timeout: float = 20.0) -> Any:
        client = self.node.create_client(srv_type, name)
        try:
            if not client.wait_for_service(timeout_sec=timeout):
                raise AssertionError(f"service {name} not available")
            future = client.call_async(request)
            done = threading.Event()
            future.add_done_callback(lambda _f: done.set())
            if not done.wait(timeout):
                raise AssertionError(f"service {name} did not answer in {timeout} s")
            return future.result()
        finally:
            self.node.destroy_client(client)

    def trigger(self, which: str) -> Any:
        from std_srvs.srv import Trigger

        return self._call(Trigger, f"{self.channel_fqn}/{which}", Trigger.Request())

    def lifecycle_state(self) -> str:
        """The managed node's state label (unconfigured, inactive, active, finalized)."""
        from lifecycle_msgs.srv import GetState

        return self._call(GetState, f"{self.fqn}/get_state", GetState.Request()).current_state.label

    def change_state(self, transition: str) -> bool:
        """Ask the managed node for a transition by label (configure, activate, deactivate, cleanup,
        shutdown); whether it succeeded."""
        from lifecycle_msgs.msg import Transition
        from lifecycle_msgs.srv import ChangeState

        request = ChangeState.Request(transition=Transition(label=transition))
        return bool(self._call(ChangeState, f"{self.fqn}/change_state", request, timeout=60.0).success)

    def set_params(self, values: Mapping[str, Any]) -> list[Any]:
        """Set parameters through ``/orin_vlm/set_parameters`` (one result per parameter)."""
        from rcl_interfaces.srv import SetParameters
        from rclpy.parameter import Parameter

        request = SetParameters.Request()
        request.parameters = [Parameter(name, value=value).to_parameter_msg() for name, value in values.items()]
        return list(self._call(SetParameters, f"{self.fqn}/set_parameters", request).results)

    def get_params(self, names: list[str]) -> dict[str, Any]:
        from rcl_interfaces.srv import GetParameters
        from rclpy.parameter import parameter_value_to_python

        request = GetParameters.Request(names=names)
        result = self._call(GetParameters, f"{self.fqn}/get_parameters", request)
        return {name: parameter_value_to_python(v) for name, v in zip(names, result.values, strict=True)}

    def close(self) -> None:
        """Stop spinning, then destroy: the spin thread must be out of its wait set before the node and the
        context it waits on go away (destroying them under a wait crashed the test process once)."""
        self._executor.shutdown(timeout_sec=2.0)
        self._spin.join(timeout=5.0)
        self.node.destroy_node()
        self._rclpy.try_shutdown(context=self.context)
