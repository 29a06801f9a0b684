"""The launch file ends the launch with the node, and a node that fails makes the launch fail: a robot's
supervisor (systemd, a watchdog) must see a node that could not start, not a launch idling with nothing
running. Runs the real ``launch`` (a sourced ROS 2 install, or ``../shared/ros2-cli`` in CI) in a child
process, like ``ros2 launch``; skipped where launch is not installed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("launch", reason="ROS 2 launch comes with a ROS 2 install only")
pytest.importorskip("launch_ros", reason="launch_ros comes with a ROS 2 install only")

from ros_harness import domain_id_for  # noqa: E402

from support.node_process import process_running  # noqa: E402

LAUNCH_FILE = Path(__file__).resolve().parent.parent / "launch" / "orin_vlm.launch.py"
RUN_LAUNCH = """
import sys
from launch import LaunchDescription, LaunchService
from launch.actions import IncludeLaunchDescription
from launch.launch_description_sources import PythonLaunchDescriptionSource

service = LaunchService()
arguments = dict(a.split(":=", 1) for a in sys.argv[2:])
service.include_launch_description(LaunchDescription([
    IncludeLaunchDescription(PythonLaunchDescriptionSource(sys.argv[1]), launch_arguments=arguments.items())
]))
sys.exit(service.run())
"""


def launch_process(tmp_path: Path, *arguments: str) -> dict:
    """``subprocess`` keywords that run the launch file with ``arguments`` like ``ros2 launch``."""
    env = {
        **os.environ,
        "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST",
        "ROS_DOMAIN_ID": str(domain_id_for(__name__)),
        "ROS_LOG_DIR": str(tmp_path / "ros_log"),
    }
    return {"args": [sys.executable, "-c", RUN_LAUNCH, str(LAUNCH_FILE), *arguments], "env": env, "cwd": tmp_path}


def run_launch(tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(**launch_process(tmp_path, *arguments), capture_output=True, text=True, timeout=180)


def test_a_node_that_cannot_start_fails_the_launch(tmp_path):
    result = run_launch(tmp_path, "page_size:=3")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert "page_size must be a power of two" in output
    assert "exited with status 1" in output


def test_image_topics_pass_through_the_launch_as_a_list_and_bad_names_fail_it(tmp_path):
    result = run_launch(tmp_path, "image_topics:=[front, 'front camera']")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert "image_topics entry 'front camera' is not a valid ROS topic name" in output


def test_sigterm_to_the_launch_stops_the_node_too(tmp_path):
    """Launch itself exits at once on SIGTERM and leaves what it started running (upstream's documented
    behaviour); the node, started with ``--stop-with-parent``, stops cleanly when the launch is gone instead
    of holding its model in memory next to the one the next launch loads."""
    log = tmp_path / "launch_output.txt"
    with open(log, "wb") as out:
        launch = subprocess.Popen(**launch_process(tmp_path, "device:=cpu"), stdout=out, stderr=subprocess.STDOUT)
    node_pid = None
    try:
        deadline = time.monotonic() + 120
        while "ready in" not in (output := log.read_text(errors="replace")):
            assert time.monotonic() < deadline and launch.poll() is None, output[-3000:]
            time.sleep(0.2)
        node_pid = int(re.search(r"process started with pid \[(\d+)\]", output).group(1))
        launch.send_signal(signal.SIGTERM)
        launch.wait(timeout=30)
        deadline = time.monotonic() + 15
        while process_running(node_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not process_running(node_pid), "the node outlived the launch"
    finally:
        if launch.poll() is None:
            launch.kill()
        if node_pid is not None and process_running(node_pid):
            os.kill(node_pid, signal.SIGKILL)
