"""orin_vlm_node: Qwen3-VL on the robot, behind a ROS 2 node.

Layers, each importable without the ones above it:
``model`` (tensor math) · ``processing`` (images, tokens, chat template) · ``kvcache`` (paged and
contiguous KV storage) · ``engine`` (requests, sessions, sampling, decode step) · ``cuda`` (kernel
build, load, launch, graphs) · ``node`` (the only module that imports rclpy).
"""

__version__ = "0.1.0"
