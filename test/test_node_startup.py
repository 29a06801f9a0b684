"""Starting the node the way `ros2 run` does (`python -m orin_vlm_node.ros.main --ros-args -p ...`):
a good checkpoint comes up and stops cleanly on SIGINT; a bad model_path or an invalid parameter
value ends the process with exit status 1 and a log line naming the problem."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("rclpy", reason="rclpy (ROS 2 wheels) is installed by `make test`")

from ros_harness import domain_id_for  # noqa: E402

from support.checkpoints import cached_tiny_checkpoint  # noqa: E402
from support.node_client import VlmClient  # noqa: E402
from support.node_process import NodeProcess, node_command, process_running, ros_env  # noqa: E402

# A stand-in for ``ros2 launch``: starts the node (argv[2:]) with its output to argv[1], prints its pid, waits.
LAUNCHER = """
import subprocess, sys, time
with open(sys.argv[1], "wb") as log:
    node = subprocess.Popen(sys.argv[2:], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
print(node.pid, flush=True)
time.sleep(600)
"""


def start(tmp_path, *args: str) -> NodeProcess:
    return NodeProcess({}, tmp_path, domain_id_for(__name__), extra_args=list(args))


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["-p", "model_path:=/nonexistent/qwen3-vl"], "model_path '/nonexistent/qwen3-vl' is not a Hugging Face model"),
        (["-p", "page_size:=24"], "page_size must be a power of two"),
        (["-p", "channels:=[arm, arm/left]"], "channels entry 'arm/left' is not a channel name"),
        # A typo that leaves parameters outside the ROS arguments must not start the default model.
        (["--", "--ros-arg", "-p", "model_path:=/opt/m"], "unknown argument(s) --ros-arg -p model_path:=/opt/m"),
    ],
    ids=["missing_model", "page_size", "channel_name", "not_ros_arguments"],
)
def test_bad_startup_parameters_exit_1_with_a_clear_error(tmp_path, args, expected):
    node = start(tmp_path, *args)
    rc = node.wait(timeout=120)
    output = node.output()
    node.stop()
    assert rc == 1, output
    assert "cannot start" in output and expected in output, output


def test_model_dir_without_weights_exits_1(tmp_path):
    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    node = start(tmp_path / "run", "-p", f"model_path:={broken}")
    rc = node.wait(timeout=120)
    output = node.output()
    node.stop()
    assert rc == 1 and "cannot start" in output, output


def test_ros_run_style_start_with_namespace_and_remap_then_sigint(tmp_path):
    checkpoint = cached_tiny_checkpoint()
    args = ["-p", f"model_path:={checkpoint}", "-p", "max_new_tokens:=4", "-p", "device:=cpu", "-p", "max_new_token:=9"]
    client = VlmClient(domain_id_for(__name__), namespace="robot7", prompt_topic="question")  # listening first
    node = start(tmp_path, *args, "-r", "__ns:=/robot7", "-r", "prompt:=question")
    try:
        client.wait_until_connected(node, timeout=120)
        # The first status event says the node serves, on which attention path, with which KV pool.
        ready = client.wait_for(lambda: client.events(event="ready"), 10, "the ready event")[0]
        assert ready["note"].startswith("kernels: off (cpu device); decode: torch reference (dynamic step); KV pool:")
        assert client.status[0]["event"] == "ready"
        result = client.ask("Hello?")
        assert result["status"]["event"] == "finished" and result["status"]["metrics"]["generated_tokens"] <= 4
    finally:
        client.close()
        rc, elapsed = node.stop(timeout=5.0)
    assert rc == 0, node.output()
    assert elapsed < 5.0
    assert "ready in" in node.output()
    assert "unknown parameter(s) ignored: max_new_token (did you mean max_new_tokens?)" in node.output()


def test_stop_with_parent_stops_the_node_cleanly_when_its_launcher_dies(tmp_path):
    """``ros2 launch`` stopped by SIGTERM exits at once and leaves what it started running; the launch file
    passes ``--stop-with-parent``, so the node gets SIGTERM from the kernel when its parent dies and stops
    the clean way. The launcher here is killed with SIGKILL once the node serves."""
    log = tmp_path / "node_output.txt"
    command = [*node_command(), "--stop-with-parent", "--ros-args", "-p", f"model_path:={cached_tiny_checkpoint()}",
               "-p", "device:=cpu"]  # fmt: skip
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(log), *command],
        stdout=subprocess.PIPE,
        env=ros_env(domain_id_for(__name__), tmp_path / "ros_log"),
        start_new_session=True,
    )
    node_pid = int(launcher.stdout.readline())
    try:
        deadline = time.monotonic() + 120
        while "ready in" not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline and process_running(node_pid), log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 15
        while process_running(node_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not process_running(node_pid), "the node outlived its launcher"
        output = log.read_text(errors="replace")
        assert "shutting down (SIGTERM received)" in output and "Traceback" not in output, output[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if process_running(node_pid):
            os.kill(node_pid, signal.SIGKILL)
