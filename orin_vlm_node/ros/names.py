"""The node's name, in a module of its own: the entry points print it before rclpy and torch are imported
(a stop during startup), and both nodes (plain and lifecycle) take it."""

NODE_NAME = "orin_vlm"
