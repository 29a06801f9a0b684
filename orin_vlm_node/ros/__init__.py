"""The ROS 2 layer: the only place that imports rclpy and the message packages.

``node`` (the ``orin_vlm`` node: topics, services, the worker thread), ``params`` (its parameters, derived
from the settings schema), ``status`` (the JSON of ``status`` events and the ``/diagnostics`` values),
``image`` (``sensor_msgs`` images to RGB arrays) and ``request_queue`` (the bounded prompt queue).
"""
