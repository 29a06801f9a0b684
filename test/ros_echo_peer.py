"""A second ROS process for the environment test: echoes `env_image` and `env_text` back on
`env_image_echo` / `env_text_echo`, and exits after echoing one of each (or after a timeout)."""

from __future__ import annotations

import sys
import time

import rclpy
from rclpy.node import Node
from sensor_msgs.msg import Image
from std_msgs.msg import String


def main() -> int:
    rclpy.init()
    node = Node("env_echo_peer")
    image_pub = node.create_publisher(Image, "env_image_echo", 10)
    text_pub = node.create_publisher(String, "env_text_echo", 10)
    echoed: set[str] = set()

    def on_image(msg: Image) -> None:
        image_pub.publish(msg)
        echoed.add("image")

    def on_text(msg: String) -> None:
        text_pub.publish(String(data="echo:" + msg.data))
        echoed.add("text")

    node.create_subscription(Image, "env_image", on_image, 10)
    node.create_subscription(String, "env_text", on_text, 10)
    print("ready", flush=True)
    deadline = time.monotonic() + 30.0
    while rclpy.ok() and echoed != {"image", "text"} and time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.1)
    # Keep spinning briefly so the echoes are delivered before the participant leaves.
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        rclpy.spin_once(node, timeout_sec=0.05)
    node.destroy_node()
    rclpy.shutdown()
    return 0 if echoed == {"image", "text"} else 1


if __name__ == "__main__":
    sys.exit(main())
