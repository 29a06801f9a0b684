"""orin_vlm_node: Qwen3-VL on the robot, behind a ROS 2 node.

Layers, each importable without the ones above it:
``model`` (Qwen3-VL's tensor math) · ``weights`` (checkpoints, stored formats, quantization, the projections'
kernels) · ``processing`` (images, tokens, chat template) · ``kvcache``
(paged and contiguous KV storage) · ``cuda`` and ``cpu`` (kernel build, load, launch, graphs) · ``engine``
(parts, scheduler, requests, sessions, sampling, decode step) · ``ros`` (the node: the only package that
imports rclpy).
"""

__version__ = "0.1.0"
