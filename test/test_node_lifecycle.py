"""The managed node (``vlm_lifecycle_node``) driven through its ``~/change_state`` service over real DDS,
as a lifecycle manager drives it: nothing loads before ``configure``, nothing is served before ``activate``,
``deactivate`` ends every open prompt with its terminal event, the node serves again after a second
``activate``, ``cleanup`` frees the model, out-of-order transitions are refused and ``shutdown`` ends the
process with status 0.

One node process for the whole sequence (the steps depend on each other, so they are one test); a second
process checks Ctrl-C while it answers.
"""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("rclpy", reason="rclpy (ROS 2 wheels) is installed by `make test`")
pytest.importorskip("lifecycle_msgs", reason="lifecycle_msgs (ROS 2 wheels) is installed by `make test`")

from ros_harness import FAST_PARAMS, domain_id_for  # noqa: E402

from orin_vlm_node.ros.params import defaults  # noqa: E402
from support.checkpoints import cached_tiny_checkpoint  # noqa: E402
from support.node_client import VlmClient  # noqa: E402
from support.node_process import MANAGED, NodeProcess  # noqa: E402

# Without an image the tiny checkpoint's greedy answer runs to max_new_tokens (see test_node_integration).
QUESTION = "Describe this image."


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _wait_for_service(client: VlmClient, name: str, node: NodeProcess, timeout: float = 60.0) -> None:
    def present() -> bool:
        assert node.alive(), node.output()
        return name in {n for n, _ in client.node.get_service_names_and_types()}

    _wait(present, timeout, name)


def test_transitions_load_serve_stop_and_free(tmp_path):
    values = {**defaults(), **FAST_PARAMS, "device": "cpu", "model_path": str(cached_tiny_checkpoint())}
    node = NodeProcess(values, tmp_path / "node", domain_id_for(__name__), executable=MANAGED,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    client = VlmClient(node.domain_id)
    try:
        _wait_for_service(client, f"{client.fqn}/change_state", node)
        assert client.lifecycle_state() == "unconfigured"
        assert "model loaded" not in node.output()
        assert not client.change_state("activate"), "activate before configure must be refused"
        assert client.lifecycle_state() == "unconfigured"
        # Parameters can be set before configure; the model loads with them.
        assert all(r.successful for r in client.set_params({"max_new_tokens": 5}))

        assert client.change_state("configure")
        assert client.lifecycle_state() == "inactive"
        time.sleep(0.5)
        assert client.prompt_pub.get_subscription_count() == 0, "an inactive node takes no prompts"

        assert client.change_state("activate")
        client.wait_until_connected(node)
        answer = client.ask(QUESTION)
        assert answer["status"]["finish_reason"] == "length"
        assert answer["status"]["metrics"]["generated_tokens"] == 5
        assert "".join(answer["tokens"]) == answer["response"]
        assert client.events(event="ready"), "activate announces ready"

        # Deactivate while a long answer runs and another prompt waits: both end, the running one cancelled.
        assert all(r.successful for r in client.set_params({"max_new_tokens": 4000}))
        before = len(client.status)
        client.send_prompt(QUESTION)
        client.send_prompt(QUESTION)
        _wait(lambda: any(e["event"] == "started" for e in client.status[before:]), 30, "the first prompt to start")
        started = next(e["request_id"] for e in client.status[before:] if e["event"] == "started")
        assert client.change_state("deactivate")

        def ends() -> list[dict]:
            return [e for e in client.status[before:] if e["event"] in ("finished", "dropped", "error")]

        client.wait_for(lambda: len(ends()) == 2, 10, "both prompts to end")
        outcome = {e["request_id"]: (e["event"], e["finish_reason"]) for e in ends()}
        assert outcome.pop(started) == ("finished", "cancelled")
        assert list(outcome.values()) == [("dropped", None)]
        assert all(e["note"] == "node deactivated" for e in ends())
        assert client.lifecycle_state() == "inactive"
        _wait(lambda: client.prompt_pub.get_subscription_count() == 0, 10, "the prompt subscription to go")

        # Parameters set while inactive apply when the node serves again.
        assert all(r.successful for r in client.set_params({"max_new_tokens": 3}))
        assert client.change_state("activate")
        client.wait_until_connected(node)
        again = client.ask(QUESTION)
        assert again["status"]["metrics"]["generated_tokens"] == 3

        assert not client.change_state("cleanup"), "cleanup of an active node must be refused"
        assert client.change_state("deactivate") and client.change_state("cleanup")
        assert client.lifecycle_state() == "unconfigured"
        assert "cleaned up: model freed" in node.output()

        assert client.change_state("shutdown")
        assert node.wait(30) == 0, node.output()
    finally:
        client.close()
        node.stop()


def test_ctrl_c_while_active_ends_the_answer_and_exits_zero(tmp_path):
    """Ctrl-C on a managed node that is answering: the running prompt ends with its terminal event and
    the process exits 0 (the shutdown transition runs from ``active``)."""
    values = {**defaults(), **FAST_PARAMS, "device": "cpu", "model_path": str(cached_tiny_checkpoint())}
    values["max_new_tokens"] = 4000
    node = NodeProcess(values, tmp_path / "node", domain_id_for(__name__ + "ctrl_c"), executable=MANAGED,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    client = VlmClient(node.domain_id)
    try:
        _wait_for_service(client, f"{client.fqn}/change_state", node)
        assert client.change_state("configure") and client.change_state("activate")
        client.wait_until_connected(node)
        client.send_prompt(QUESTION)
        client.wait_for(lambda: client.tokens, 30, "the first token")
        code, _ = node.stop(timeout=20.0)
        assert code == 0, node.output()
        end = client.wait_for(lambda: client.events(event="finished"), 10, "the answer's terminal event")
        assert end[0]["finish_reason"] == "cancelled", end
    finally:
        client.close()
        node.stop()


def test_ctrl_c_while_configure_compiles_stops_the_compile_and_exits_zero(tmp_path):
    """``configure`` loads the model in a ROS callback, compiling the node's kernels on a first start. A stop
    signal then kills the compilers (it would otherwise wait for them: a minute of nvcc on a Jetson), the
    load ends without them and the process exits 0, leaving nothing running."""
    import signal
    import threading

    from support.node_process import compiler_of, processes

    values = {**defaults(), **FAST_PARAMS, "device": "cpu", "model_path": str(cached_tiny_checkpoint())}
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}  # nothing cached: configure compiles
    node = NodeProcess(values, tmp_path / "node", domain_id_for(__name__ + "compiling"), executable=MANAGED, env=env)
    client = VlmClient(node.domain_id)
    try:
        _wait_for_service(client, f"{client.fqn}/change_state", node)
        threading.Thread(target=lambda: client.change_state("configure"), daemon=True).start()  # answered or not
        compiler = compiler_of(node, "cpu_gemm")
        assert compiler is not None, "configure never compiled the CPU library: " + node.output()[-2000:]
        t0 = time.monotonic()
        node.proc.send_signal(signal.SIGINT)
        assert node.wait(20.0) == 0, node.output()[-3000:]
        assert time.monotonic() - t0 < 5, f"the stop took {time.monotonic() - t0:.1f} s"  # 0.6 s here, 10 s before
        left = [cmd for _, _, session, cmd in processes() if session in (node.proc.pid, compiler)]
        assert not left, f"left running: {left}"
        assert "Traceback" not in node.output(), node.output()[-3000:]
    finally:
        client.close()
        node.stop()
