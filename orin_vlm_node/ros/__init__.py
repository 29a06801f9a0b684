"""The ROS 2 layer: the only place that imports rclpy and the message packages.

``main`` (the ``vlm_node`` entry point and its signal handling), ``node`` (the ``orin_vlm`` node: topics,
services, shutdown), ``worker`` (the thread that runs prompts through the engine), ``params`` (its
parameters, derived from the settings schema), ``status`` (the JSON of ``status`` events and the
``/diagnostics`` values), ``image`` and ``image_header`` (``sensor_msgs`` images to RGB arrays, sizes read
before decoding), ``image_inputs`` (image subscriptions matched to their publishers), ``request_queue``
(the bounded prompt queue), ``token_stream`` (coalesced token publishing) and ``log_bridge`` (the ROS-free
layers' Python log records in the node's ROS log).
"""
