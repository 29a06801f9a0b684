"""The ROS environment CI relies on: two rclpy processes exchange a sensor_msgs/Image and a
std_msgs/String over DDS with localhost-only discovery."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy", reason="rclpy (ROS 2 wheels) is installed by `make test`")

from rclpy.node import Node  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from std_msgs.msg import String  # noqa: E402

from support.node_process import domain_id_for  # noqa: E402

PEER = Path(__file__).with_name("ros_echo_peer.py")


def test_discovery_is_localhost_only():
    assert os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] == "LOCALHOST"


def test_two_processes_exchange_image_and_string(tmp_path, monkeypatch):
    domain = str(domain_id_for(__name__))
    env = dict(os.environ, ROS_DOMAIN_ID=domain, ROS_LOG_DIR=str(tmp_path), ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST")
    monkeypatch.setenv("ROS_DOMAIN_ID", domain)  # this process joins the same private domain
    peer = subprocess.Popen(
        [sys.executable, str(PEER)], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert peer.stdout.readline().strip() == "ready"
        rclpy.init()
        node = Node("env_test")
        got: dict[str, object] = {}
        node.create_subscription(Image, "env_image_echo", lambda m: got.setdefault("image", m), 10)
        node.create_subscription(String, "env_text_echo", lambda m: got.setdefault("text", m), 10)
        image_pub = node.create_publisher(Image, "env_image", 10)
        text_pub = node.create_publisher(String, "env_text", 10)

        pixels = np.random.default_rng(0).integers(0, 256, size=(48, 64, 3), dtype=np.uint8)
        img = Image(height=48, width=64, encoding="rgb8", is_bigendian=0, step=64 * 3)
        img.data = pixels.tobytes()
        deadline = time.monotonic() + 20.0
        while len(got) < 2 and time.monotonic() < deadline:
            image_pub.publish(img)
            text_pub.publish(String(data="hello 你好"))
            rclpy.spin_once(node, timeout_sec=0.2)
        node.destroy_node()
        rclpy.shutdown()
    finally:
        rc = peer.wait(timeout=30)
    assert rc == 0
    assert got["text"].data == "echo:hello 你好"
    echoed = got["image"]
    assert (echoed.height, echoed.width, echoed.encoding, echoed.step) == (48, 64, "rgb8", 192)
    assert np.array_equal(np.frombuffer(bytes(echoed.data), np.uint8).reshape(48, 64, 3), pixels)
