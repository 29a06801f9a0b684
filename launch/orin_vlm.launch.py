"""Launch the orin_vlm node: a parameter file plus optional per-launch overrides and topic remaps.

    ros2 launch orin_vlm_node orin_vlm.launch.py
    ros2 launch orin_vlm_node orin_vlm.launch.py params_file:=<share>/config/jetson_2b.yaml \
        model_path:=/opt/models/Qwen3-VL-2B-Instruct image_topic:=/camera/color/image_raw namespace:=robot1

``lifecycle:=true`` starts the managed node instead (``vlm_lifecycle_node``: the model loads on ``configure``,
the node serves once ``active``; drive it with ``ros2 lifecycle set`` or a lifecycle manager).

Every parameter of the node (the settings schema, ``orin_vlm_node.settings``) is also a launch argument
of the same name. Why overrides are applied only when given: a launch argument left at '' must not
overwrite the value of the chosen ``params_file`` (a preset would otherwise be silently reset to the
node's defaults), so the parameter dictionary is built at launch time from the arguments that were set.

When the node exits the launch ends with it, and a node that failed (a bad startup value, a missing model)
makes ``ros2 launch`` exit non-zero, so the robot's supervisor (systemd, a watchdog) sees the failure
instead of a launch that idles on with nothing running.
"""

from __future__ import annotations

import os

from launch.actions import DeclareLaunchArgument, EmitEvent, OpaqueFunction, RegisterEventHandler
from launch.event_handlers import OnProcessExit
from launch.events import Shutdown
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node

from launch import LaunchDescription
from orin_vlm_node.settings import SETTINGS, Value

HERE = os.path.dirname(os.path.abspath(__file__))
# Same relative place in the source tree and in the install space (share/orin_vlm_node/{launch,config}).
DEFAULT_PARAMS = os.path.normpath(os.path.join(HERE, "..", "config", "orin_vlm.yaml"))


def _typed(name: str, raw: str, kind: type) -> Value:
    """Launch-argument text -> the parameter's type, with an error naming the argument."""
    if kind is bool:
        low = raw.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"launch argument {name}:={raw!r} is not a boolean (true/false)")
    if kind is list:  # image_topics:="[front, wrist]" or image_topics:=front,wrist
        return [item.strip().strip("'\"") for item in raw.strip().strip("[]").split(",") if item.strip()]
    try:
        return kind(raw)
    except ValueError as exc:
        raise ValueError(f"launch argument {name}:={raw!r} is not a valid {kind.__name__}") from exc


def _make_node(context, *_args, **_kwargs):
    params_file = LaunchConfiguration("params_file").perform(context)
    overrides = {}
    for setting in SETTINGS:
        raw = LaunchConfiguration(setting.name).perform(context)
        if raw != "":
            overrides[setting.name] = _typed(setting.name, raw, setting.type)
    lifecycle = LaunchConfiguration("lifecycle").perform(context)
    image_topic = LaunchConfiguration("image_topic").perform(context)
    compressed_topic = LaunchConfiguration("compressed_image_topic").perform(context) or f"{image_topic}/compressed"
    remappings = [
        ("image", image_topic),
        ("image/compressed", compressed_topic),
        ("prompt", LaunchConfiguration("prompt_topic").perform(context)),
    ]
    node = Node(
        package="orin_vlm_node",
        executable="vlm_lifecycle_node" if _typed("lifecycle", lifecycle, bool) else "vlm_node",
        name="orin_vlm",
        namespace=LaunchConfiguration("namespace").perform(context),
        parameters=[params_file, overrides] if overrides else [params_file],
        remappings=remappings,
        arguments=["--stop-with-parent"],  # the node stops when this launch dies, even by SIGTERM
        ros_arguments=["--log-level", LaunchConfiguration("log_level").perform(context)],
        output="screen",
        emulate_tty=True,
    )
    return [node, RegisterEventHandler(OnProcessExit(target_action=node, on_exit=_end_launch))]


class NodeFailed(RuntimeError):
    """The node exited with a non-zero status; raised inside launch so ``ros2 launch`` exits non-zero."""


def _end_launch(event, _context):
    """The node is gone: end the launch; when it failed, fail the launch (launch returns 1 on an exception)."""
    if event.returncode:
        raise NodeFailed(f"{event.action.name} exited with status {event.returncode}; see its log above")
    return [EmitEvent(event=Shutdown(reason=f"{event.action.name} exited"))]


def generate_launch_description() -> LaunchDescription:
    arguments = [
        DeclareLaunchArgument("params_file", default_value=DEFAULT_PARAMS, description="node parameter YAML"),
        DeclareLaunchArgument("namespace", default_value="", description="namespace of the node and its topics"),
        DeclareLaunchArgument("image_topic", default_value="image", description="sensor_msgs/Image input"),
        DeclareLaunchArgument(
            "compressed_image_topic",
            default_value="",
            description="CompressedImage input; '' = <image_topic>/compressed",
        ),
        DeclareLaunchArgument("prompt_topic", default_value="prompt", description="std_msgs/String prompts"),
        DeclareLaunchArgument("log_level", default_value="info", description="debug, info, warn, error"),
        DeclareLaunchArgument(
            "lifecycle",
            default_value="false",
            description="true: the managed node (vlm_lifecycle_node): loads the model on configure, serves once active",
        ),
    ]
    arguments += [
        DeclareLaunchArgument(
            s.name,
            default_value="",
            description=f"override {s.name} ({s.type.__name__}): {s.description}; '' = params_file",
        )
        for s in SETTINGS
    ]
    return LaunchDescription([*arguments, OpaqueFunction(function=_make_node)])
